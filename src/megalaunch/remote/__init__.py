"""Remote use over SSH: the commands on runs (submit, status, logs, trigger, cancel, resume) typed on a
laptop run on the login node through OpenSSH's own client (the user's keys and ~/.ssh/config, one
connection reused through a control socket), with the local recipe files sent along and the secrets
the job needs passed on stdin, never in a command line. docs/remote.md.

ssh.py builds every `ssh` command line and turns its failures into one line; ship.py decides what
travels; wire.py is the little protocol on stdin/stdout; client.py runs on the laptop, server.py on the
login node (`megalaunch remote-side`, which the client starts); route.py decides whether a command
goes remote at all. May use: config, launcher, rundir, errors (standard library otherwise)."""
