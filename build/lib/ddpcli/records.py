"""The files a rank and its launcher leave each other, beside a launch's private worker
config: their names, which both sides read. The launcher (its agent) writes some and the
ranks others; keeping the names here lets training/ read them without importing launcher/.
"""

# The agent's notice that another rank failed: a rank stopped by the agent's SIGTERM then
# leaves at once, named as stopped for its peer, instead of saving as for a preemption.
PEER_FAILED_FILE = "peer-failed"
# Marks every start of the workers after the agent's first: they continue the run.
LATER_ROUND_FILE = "later-round"
# Rank 0's word on a stop every rank found together (the launcher says it once).
AGREED_STOP_FILE = "agreed-stop.json"
