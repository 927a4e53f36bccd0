"""Recovery, on the scheduler's side of a job: what the login node and the batch script do when ranks end.

- `resume.py`: `hpcscale resume RUN` on a login node: diagnose how the last attempt ended (sacct, the logs'
  rank-failure lines, the nodes' health), pick the newest checkpoint that verifies, exclude the nodes to blame
  and resubmit (or rerun locally), recording the decision in the run directory.
- `requeue.py`: the batch script's decision after its ranks end (`hpcscale requeue RUN --exit-code N`): requeue
  the job itself after a stop signal, a time limit or a failure, within the job spec's restart budget.

Neither runs inside a rank: the rank side (hpcscale.launch) only writes what these read (failure lines,
attempt events, metrics).
"""
