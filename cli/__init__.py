"""The ``diffcache`` command line: the composition root that starts and wires every role."""
