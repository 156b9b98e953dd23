"""The memory planner of step 3 (``python -m dschat.plan``): exact model states per GPU and host
(:mod:`dschat.plan.model_state`), the PPO step's phases (:mod:`dschat.plan.phases`, an estimate),
and the configurations that fit (:mod:`dschat.plan.cli`)."""
