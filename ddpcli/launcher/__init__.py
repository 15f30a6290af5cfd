"""Starting, watching and stopping ranks: everything between a validated config and the
workers, on this node and across nodes.

- `resolve`: a train config checked against this machine, every exit 2 before workers start;
  `resources`: processes against cores, memory against what is free (warnings);
- `launch`: workers started through torch.distributed.elastic (or adopted from a launcher),
  `fork` (forked from a fork server, which `fork_server_setup` keeps alive through a signal
  to the whole job), `membership` (elastic `--nnodes MIN:MAX`), `rollcall` (every node
  reports to node 0 first);
- `failure_report`, `peer_failure`, `restarts`: a failed rank in words, what the agent tells
  the others, each restart said;
- `scriptlaunch` and `bootstrap`: `ddpcli launch`, a user's script in each worker.

May import training/ (the worker each rank runs, what --precision auto becomes), outputs/
(the run folder, the curves), data/ and models/ (their checks), config/, environments/ and
the shared top-level modules; never cli/. tests/test_architecture.py holds the table.
"""
