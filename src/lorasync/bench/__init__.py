"""The ``lorasync bench`` machinery: sync strategies measured on emulated links.

    cli          the subcommand: its arguments, and which bench a call runs
    progressive  the progressive-optimization bench, one worker per node
    topology     the N x G bench (flat against hierarchical) and its rescore
    rows         a row of the 2-node bench: running it, the probe, its summary
    chart        the progressive bench's efficiency chart
    tables       results as text: the tables and verdicts of both benches
    profiles     link profiles: parsing, round trips, time dilation

Imports point down this list only.  The scripts in the repository's bench/
folder use rows, tables and profiles; nothing imports cli but lorasync.cli.
"""
