"""What exists only so verl's trainer and kvtier's rollout run on this CPU machine (a GPU job loads none of
it): verl's `cpu` platform and its `torch.cuda` stand-in (`verl_platform`, `device_module`), the
`kvtier rl smoke` launcher, its toy task and its event hooks (`rl_smoke`, `toy_task`, `rl_smoke_hooks`), a local Ray rollout
without the trainer (`local`, `demo`) (they patch verl through `kvtier.rollout.import_hooks`).
The backend a GPU job loads is the rest of `kvtier.rollout` (verl_plugin, replica, server, adapter, ...)."""
