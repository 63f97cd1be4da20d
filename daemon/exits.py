"""The exit codes of ``gossipd`` and of a node's follower processes, in one place.

0: done; 1: failed while running; 2: the operator's to fix before it can start (bad usage,
config, file, key or task: one line says which); 3: ``gossipd status`` found no daemon;
4: ``gossipd status --ready`` found one that is not ready yet. A process killed by a signal
exits 128 + the signal's number, as shells report it.
"""

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_RUNNING, EXIT_NOT_READY = 0, 1, 2, 3, 4
