"""Scores of frozen models stored beside the data: the score store (`store`: DPO's reference
log-probabilities, a teacher's top-k), written by scoring stages and read by the flows.

May use: runtime.rank."""
