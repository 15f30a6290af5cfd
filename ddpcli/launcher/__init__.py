"""Starting, watching and stopping ranks: everything between a validated config and the
workers, on this node and across nodes.

- `plan`: one run's plan made from its request by one function, `plan_run`, in order:
  `resolve` (the request checked against this machine, every exit 2 before workers start),
  the precision, the model checked, the resume file checked and stamped;
  `resources`: processes against cores, memory against what is free (warnings);
- `engine`: what every command starts its workers on (train, eval, bench-barrier, launch):
  a WorkerJob run through torch.distributed.elastic, the workers' environment, a static
  job's roll call, a failed or stopped job in words; with `fork` (workers forked from a
  fork server, which `fork_server_setup` keeps alive through a signal to the whole job),
  `membership` (elastic `--nnodes MIN:MAX`), `rollcall` (every node reports to node 0
  first; check-env's probe gathers its nodes with it too);
- `failure_report`, `peer_failure`, `restarts`: a failed rank in words, what the agent tells
  the others, each restart said;
- each command's own launch on the engine: `train_launch` (`ddpcli train`: a launcher's
  rank adopted, or the run's workers started, rank 0's summary read, the curves drawn),
  `script_launch` with `bootstrap` (`ddpcli launch`: a user's script in each worker).
  `eval`'s lives in evaluation/launch.py and bench-barrier's in barrier/run.py: they hand
  their ranks what those packages define, and this one never imports them.

May import training/ (the worker each rank runs, what --precision auto becomes), checkpoint/
(the resume file checked), outputs/ (the run folder, the curves), data/ and models/ (their
checks), config/, environments/ and the shared top-level modules; never cli/.
tests/test_architecture.py holds the table.
"""
