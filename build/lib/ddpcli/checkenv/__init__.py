"""`ddpcli check-env`: what a person runs on every node before a multi-GPU or multi-node
job, so that the job does not hang at init.

May import launcher/ (resolve's GPU check; the probe gathers its nodes by rollcall), config/,
environments/ and the shared top-level modules. Imports run one way, and nothing here imports
torch at module level (the CLI stays quick):

    facts, network   read this node once (torch, nvidia-smi, `ip`, the environment)
    checks           turn facts + options into rows (network_checks: the network's rows)
    report           the rows and the document `--json` prints
    probe            `--probe`'s parent side, given the checks' facts (probe_plan, probe_ranks,
                     probe_rows); probe_worker is what runs in each probe process
"""
