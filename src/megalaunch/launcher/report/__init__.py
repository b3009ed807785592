"""`megalaunch report RUN`, one module per concern: where the report goes and writing it (`write`, the
CLI's only import), reading the run directory (`data`), names and colours shared by figures and page
(`style`), the PNG figures (`figures`, matplotlib imported inside), and the HTML page (`page`).

May use: launcher.accounting, config, rundir."""
