"""The stop protocol: the stop signal blocked everywhere but in one waiting thread (`signals`), the signal
flag and the trigger files folded into one decision that every rank takes at the same iteration
(`decisions`), and the signal window at the end of a segment in which a periodic save gives way to the
stop save (`stop_window`).

May use: runtime.rank, runtime.observation (the timeline records each decision)."""
