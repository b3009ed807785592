"""Parts of the recipe's training: post-training methods (post_training.py)."""
