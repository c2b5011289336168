"""The learning-rate and weight-decay schedule, and how a resumed job takes it: the checkpoint's or the config's,
never one of them silently.

Megatron-Core 0.19.2's ``OptimizerParamScheduler`` defaults to ``use_checkpoint_opt_param_scheduler=True``: a job
resumed with another ``lr``, ``train_iters`` or warm-up would keep the checkpoint's schedule without a word. As in
Megatron-LM, a difference stops the job unless one of two flags says which wins: ``override_opt_param_scheduler``
(the config's schedule from the resumed step on) or ``use_checkpoint_opt_param_scheduler`` (the checkpoint's).
The step count always comes from the checkpoint.
"""

from __future__ import annotations

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_ext.errors import ConfigError

# Scheduler state key -> the config key that sets it (build_scheduler).
CONFIG_KEY_OF = {
    "max_lr": "lr",
    "min_lr": "min_lr",
    "lr_warmup_steps": "lr_warmup_iters",
    "lr_decay_steps": "lr_decay_iters (null: train_iters)",
    "lr_decay_style": "lr_decay_style",
    "start_wd": "weight_decay",
    "end_wd": "weight_decay",
    "wd_incr_style": "weight decay style (constant)",
    "wd_incr_steps": "train_iters",
}
RESUME_FLAGS = ("--override-opt-param-scheduler (the config's schedule from the resumed step on) or "
                "--use-checkpoint-opt-param-scheduler (the checkpoint's)")


def build_scheduler(optimizer, train) -> OptimizerParamScheduler:
    """Linear warm-up from 0 to ``train.lr``, then ``lr_decay_style`` to ``min_lr`` over ``lr_decay_iters``
    (default ``train_iters``); constant weight decay."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=train.lr,
        min_lr=train.min_lr,
        lr_warmup_steps=train.lr_warmup_iters,
        lr_decay_steps=train.lr_decay_iters or train.train_iters,
        lr_decay_style=train.lr_decay_style,
        start_wd=train.weight_decay,
        end_wd=train.weight_decay,
        wd_incr_steps=train.train_iters,
        wd_incr_style="constant",
    )


def schedule_differences(scheduler: OptimizerParamScheduler, saved: dict) -> list[str]:
    """``"key: config X, checkpoint Y"`` for each schedule value the checkpoint's state ``saved`` holds otherwise.
    The weight-decay steps only count where the decay changes over steps (not ``constant``)."""
    ours = scheduler.state_dict()
    constant_wd = ours["wd_incr_style"] == saved.get("wd_incr_style") == "constant"
    out = []
    for key, config_key in CONFIG_KEY_OF.items():
        if key not in saved or (key == "wd_incr_steps" and constant_wd):
            continue
        if ours[key] != saved[key]:
            out.append(f"{config_key}: config {ours[key]!r}, checkpoint {saved[key]!r}")
    return sorted(set(out))


def check_schedule(scheduler: OptimizerParamScheduler, saved: dict | None, ckpt, source: str) -> list[str]:
    """:func:`schedule_differences`; :class:`ConfigError` if there are any and neither of ``ckpt``'s two flags
    is set (also called before the checkpoint's tensors are read, so a refused job stops at once)."""
    differences = [] if saved is None else schedule_differences(scheduler, saved)
    if differences and not (ckpt.override_opt_param_scheduler or ckpt.use_checkpoint_opt_param_scheduler):
        raise ConfigError(f"resuming {source}: the learning-rate schedule differs from the checkpoint's ("
                          f"{'; '.join(differences)}); pass {RESUME_FLAGS}")
    return differences


def load_optimizer_and_schedule(optimizer, scheduler: OptimizerParamScheduler, optimizer_state, saved: dict | None,
                                ckpt, source: str, log=print) -> None:
    """Load ``optimizer_state`` into ``optimizer`` and ``saved`` (the checkpoint's scheduler state, None if it has
    none) into ``scheduler``, taking the schedule ``ckpt`` says: the checkpoint section's
    ``override_opt_param_scheduler`` / ``use_checkpoint_opt_param_scheduler``. Raises :class:`ConfigError` naming the
    differing keys when the schedules differ and neither flag is set, before anything is loaded.

    Megatron pairs the saved param groups with the live ones by their settings, ``max_lr`` and ``min_lr``
    included, and the load replaces the live groups with the saved ones: with another ``lr`` the pairing fails
    (``Could not find parameter group with key``). So the live groups take the checkpoint's values for the load,
    and the config's again after it where the config wins. ``source``: the checkpoint, for messages."""
    if saved is None:
        optimizer.load_state_dict(optimizer_state)
        return
    differences = check_schedule(scheduler, saved, ckpt, source)
    config_lrs = {"max_lr": scheduler.max_lr, "min_lr": scheduler.min_lr}
    saved_lrs = {key: saved[key] for key in config_lrs}
    _replace_group_values(optimizer, config_lrs, saved_lrs)
    optimizer.load_state_dict(optimizer_state)
    if ckpt.override_opt_param_scheduler:
        _replace_group_values(optimizer, saved_lrs, config_lrs)
    # Megatron's own check would also compare the unused weight-decay steps: the choice is made above.
    scheduler.override_opt_param_scheduler = ckpt.override_opt_param_scheduler
    scheduler.use_checkpoint_opt_param_scheduler = not ckpt.override_opt_param_scheduler
    scheduler.load_state_dict(saved)
    if differences:
        winner = "config's" if ckpt.override_opt_param_scheduler else "checkpoint's"
        log(f"> LR schedule: the {winner} ({'; '.join(differences)}), from step {scheduler.num_steps}")


def _replace_group_values(optimizer, old: dict, new: dict) -> None:
    """In every param group of ``optimizer``: ``key``'s value ``old[key]`` becomes ``new[key]`` (groups whose own
    value differs, e.g. a decoupled LR, keep it)."""
    for group in optimizer.param_groups:
        for key, value in old.items():
            if group.get(key) == value:
                group[key] = new[key]
