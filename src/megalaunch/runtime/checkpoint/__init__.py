"""Checkpoints inside the job: which one a segment loads and the fallback when it is unreadable
(`resume`, `completeness`: only complete checkpoints are trusted), what happens around every save and
the storage_full ending (`checkpoints`, the room), which ones stay on disk (`retention`), and the
read-ahead of the one to load while Python imports (`readahead`).

May use: runtime.rank."""
