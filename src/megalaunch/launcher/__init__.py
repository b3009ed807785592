"""Login-node side of a run: preparing and rendering it, executing it (Slurm, local), the chain of
segments, and what the user asks of it. Here: the commands' library functions that read across the
parts, `status` (with its text, `status_format`, and the ledger's history lines, `status_history`),
`logs` and `control` (who may act on a run). The parts, each a sub-package whose docstring says what
it owns and what it may use (tests/unit/test_architecture.py holds the rules):

    backends     Slurm and local execution, the backend registry      uses chain, prepare, accounting
    chain        segment begin/end, restarts, notifications, resume  uses prepare, accounting
    report       the goodput report: data, figures, page             uses accounting
    prepare      recipe -> run directory, job script, signal lead    uses nothing of the launcher
    accounting   goodput, failure evidence, suspect nodes, disk plan  uses nothing of the launcher
"""
