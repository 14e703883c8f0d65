"""What exists only so verl's trainer and kvtier's rollout run on this CPU machine (a GPU job loads none of
it): verl's `cpu` platform and its `torch.cuda` stand-in (`verl_platform`, `device_module`), the
`kvtier rl smoke` launcher and its event hooks (`rl_smoke`, `rl_smoke_hooks`), a local Ray rollout
without the trainer (`local`, `demo`), and the import hooks they patch verl through (`import_hooks`).
The backend a GPU job loads is the rest of `kvtier.rollout` (verl_plugin, replica, server, adapter, ...)."""
