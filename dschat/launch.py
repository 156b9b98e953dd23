"""Turn a recipe into a ``deepspeed`` command, run it, stream its output to the terminal and a log.

    python -m dschat.launch <step> <recipe-id> [--output_dir DIR] [--zero_stage N] ...
                            [--num_gpus N] [--hostfile F] [--dry-run] [-- --extra_flag value ...]

The command is an argument list (``deepspeed [launcher options] training/<step>/main.py <flags>``)
run without a shell. Output is read in raw chunks, so progress bars (``\\r``) show
live, and written both to the terminal and to ``<output_dir>/training.log``
(docs/upstream.md#small-fixes). The exit code is the step's.

The shell recipes in ``training/*/training_scripts/`` call this module with ``--script-args "$@"``:
upstream-style positionals (``$1``..``$5``, empty for the default) followed by extra ``main.py`` flags.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

from dschat.cli.shared import user_path
from dschat.errors import EXIT_USAGE, UserError, cli_main
from dschat.launch_log import LogTee, Redactor, TerminalSink, shown_argv, terminal_writer
from dschat.paths import STARTED_FILE_VAR
from dschat.multinode import (DEEPSPEED_FORWARDS, DEFAULT_MASTER_PORT, ENV_FILE_VAR, RENDEZVOUS_ID_VAR, Hosts,
                              check_forwarded_env, check_master_port, check_remote_safe, flag_values,
                              forwarded_secrets, free_port, launch_hosts, rank_env, rank_env_additions,
                              secret_env_lines, secret_rank_values, user_env_files, write_rank_env_file)
from dschat.recipes.loading import find_repo_root, get_recipe
from dschat.recipes.recipe import Launcher, Recipe, split_flag_groups
from dschat.recipes.steps import StepSpec, step_spec
from dschat.runtime.fs import check_writable_dir
from dschat.runtime.trust import untrusted_reason

LAUNCHER_ENV = "DSCHAT_LAUNCHER"  # replaces the deepspeed executable (tests, custom wrappers)
PREFIX = "[dschat.launch]"

# -------------------------------------------------------------------------------------------------
# Out-of-memory detection and advice (step 3's most reported upstream problem: docs/upstream.md#out-of-memory-in-step-3)
# -------------------------------------------------------------------------------------------------
_OOM_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (label, re.compile(pattern, re.IGNORECASE))
    for label, pattern in (
        ("CUDA out of memory", r"CUDA out of memory"),
        ("torch.OutOfMemoryError", r"OutOfMemoryError"),
        ("CPU allocator failed", r"DefaultCPUAllocator: can't allocate memory"),
        ("std::bad_alloc", r"std::bad_alloc"),
        ("MemoryError", r"^\s*MemoryError\b|\bMemoryError:"),
        ("cannot allocate memory", r"Cannot allocate memory"),
        ("out of memory", r"\bout of memory\b"),
        ("a rank was killed (SIGKILL, usually the kernel's out-of-memory killer)", r"exits with return code = -9\b"),
    )
)
# -9 direct, 137 = 128 + SIGKILL from a shell, 247 = the deepspeed launcher's sys.exit(-9).
_SIGKILL_CODES = (-9, 137, 247)


def detect_oom(output_tail: str, returncode: int | None) -> str | None:
    """Why a failed step looks like an out-of-memory death, or ``None``."""
    if returncode == 0:
        return None
    for label, pattern in _OOM_PATTERNS:
        if pattern.search(output_tail):
            return label
    if returncode in _SIGKILL_CODES:
        return "the process was killed with SIGKILL (usually the kernel's out-of-memory killer)"
    return None


def oom_advice(step: StepSpec | str, *, cpu: bool = False, e2e: bool = False) -> str:
    """What to change when ``step`` runs out of memory (upstream's e2e advice plus the remedies its users reported)."""
    spec = step if isinstance(step, StepSpec) else step_spec(step)
    lines = [f"Step {spec.number} ({spec.title}) ran out of memory. Ways to make it fit:"]
    if spec.key == "step3":
        lines += [
            "  - smaller --per_device_generation_batch_size and --per_device_training_batch_size (keep them "
            "equal) with more --gradient_accumulation_steps",
            "  - shorter --max_prompt_seq_len / --max_answer_seq_len",
            "  - ZeRO-3 for actor and critic (--actor_zero_stage 3 --critic_zero_stage 3"
            + ("; e2e: --actor-zero-stage 3 --reward-zero-stage 3" if e2e else "") + ")",
            "  - --actor_gradient_checkpointing --critic_gradient_checkpointing (step 1's "
            "--gradient_checkpointing does not apply here)",
            "  - LoRA: --actor_lora_dim 128 --critic_lora_dim 128 --only_optimize_lora",
            "  - offload: --offload (needs ZeRO 1-3), --offload_reference_model / --offload_reward_model "
            "(need the actor / critic at ZeRO-3)",
            "  - with the Hybrid Engine: --release_inference_cache",
            "  - under ZeRO-3: --zero3_gather_for_generation off, --zero3_gather_for_scoring off (and "
            "--zero3_gather_for_training off where you set it on): fetch module by module, no model held whole",
            "  - rule of thumb (upstream): actor + critic fit in about (GPU memory in GB / 6) billion parameters",
        ]
    else:
        lines += [
            "  - smaller --per_device_train_batch_size / --per_device_eval_batch_size with more "
            "--gradient_accumulation_steps",
            "  - shorter --max_seq_len",
            "  - a higher ZeRO stage on multi-GPU setups (--zero_stage 3"
            + ("; e2e: --actor-zero-stage / --reward-zero-stage" if e2e else "") + ")",
            "  - --gradient_checkpointing",
            "  - LoRA: --lora_dim 128 --only_optimize_lora",
            "  - --offload with --zero_stage 1-3 (optimizer in CPU memory; ZeRO-3: the parameters too)",
        ]
    if cpu:
        lines.append("  - on a CPU this is RAM: run one rank (--num_gpus 1) and close other programs")
    lines.append("Flags can be appended after the recipe's (python -m dschat.launch ... -- --flag value) "
                 "or changed in configs/.")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------
# The command
# -------------------------------------------------------------------------------------------------
def deepspeed_executable() -> list[str]:
    """The ``deepspeed`` launcher to run: ``$DSCHAT_LAUNCHER`` (split like a shell would), the one
    beside this Python, the one on ``PATH``, or ``python -m deepspeed.launcher.runner``."""
    override = os.environ.get(LAUNCHER_ENV)
    if override:
        try:
            return shlex.split(override)
        except ValueError as err:  # an unclosed quote
            raise UserError(f"${LAUNCHER_ENV} ({override}) does not split into a command ({err}); "
                            "fix its quoting or unset it") from None
    beside = Path(sys.executable).with_name("deepspeed")
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside)]
    found = shutil.which("deepspeed")
    if found:
        return [found]
    return [sys.executable, "-m", "deepspeed.launcher.runner"]


@dataclass
class LaunchPlan:
    """Everything needed to run one step: the argv, environment additions and the log file."""

    recipe: Recipe
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # defaults: a variable already set wins
    output_dir: Path | None = None
    main_py: Path | None = None
    env_set: dict[str, str] = field(default_factory=dict)  # always set (PYTHONPATH)
    hosts: Hosts | None = None  # None: no launcher (kind "python")
    # Multi-node: variables the remote ranks need that no .deepspeed_env of the user sets; run()
    # writes them into the launch's own copy of that file.
    rank_env: dict[str, str] = field(default_factory=dict)
    # Multi-node: secret-named variables DeepSpeed would forward on the remote command line; run()
    # removes them from the launcher's environment (their values never leave this process).
    withheld: list[str] = field(default_factory=list)

    @property
    def log_path(self) -> Path | None:
        return self.output_dir / "training.log" if self.output_dir is not None else None

    def command_line(self) -> str:
        """The command as lines and ``training.log`` show it: a URL flag's user, password and query hidden
        (:func:`~dschat.launch_log.shown_argv`; the command runs with them)."""
        return shlex.join(shown_argv(self.argv))


def flag_value(argv: Sequence[str], name: str) -> str | None:
    """The value of the last ``--name value`` / ``--name=value`` in ``argv``."""
    value = None
    for i, token in enumerate(argv):
        if token == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(f"--{name}="):
            value = token.split("=", 1)[1]
    return value


LAUNCHER_FLAGS = ("hostfile", "master_addr", "master_port", "num_nodes", "num_gpus")  # taken from script args


def resolve_launcher(recipe: Recipe, overrides: Mapping[str, object] | None) -> tuple[Launcher, Hosts]:
    """The launcher options for ``recipe`` with the user's ``overrides``, and the hosts they select.

    A single-node launch without a ``--master_port`` from the user gets a free port (as ``torchrun
    --standalone``): the launcher's default 29500, or a recipe's fixed port, may be held by another
    job on the machine. A multi-node launch keeps the given port, the recipe's or 29500, because
    every host must agree on it; when the first host is this machine, the port is checked here.
    A ``--num_gpus`` or ``--num_nodes`` override below 1 is one :class:`UserError` line.
    """
    overrides = dict(overrides or {})
    for name in ("num_gpus", "num_nodes"):
        value = overrides.get(name)
        if isinstance(value, int) and value < 1:  # deepspeed would run on none (or every) GPU of the node
            raise UserError(f"--{name} must be >= 1, got {value}")
    launcher = recipe.launcher.with_overrides(**overrides)
    if (launcher.include or launcher.exclude) and (launcher.num_gpus is not None or launcher.num_nodes is not None):
        raise UserError(f"{recipe.label}'s launcher has include/exclude and num_gpus/num_nodes, which DeepSpeed's "
                        "launcher refuses together; keep one of them")
    hosts = launch_hosts(launcher.hostfile, launcher.num_nodes, launcher.include, launcher.exclude)
    launcher = visible_gpus(launcher, hosts, os.environ.get("DS_ACCELERATOR", recipe.env.get("DS_ACCELERATOR")))
    given = overrides.get("master_port")
    if given is None and not hosts.multi_node:
        return launcher.with_overrides(master_port=free_port()), hosts
    if given is not None:
        source = "--master_port"
    elif launcher.master_port is not None:
        source = f"{recipe.label}'s launcher port"
    else:
        source = "the launcher's default"
    port = launcher.master_port if launcher.master_port is not None else DEFAULT_MASTER_PORT
    check_master_port(port, hosts, source)
    return launcher, hosts


def visible_gpus(launcher: Launcher, hosts: Hosts, accelerator: str | None) -> Launcher:
    """``--num_gpus N`` on this machine alone under ``CUDA_VISIBLE_DEVICES`` (GPU ids): ``--include
    localhost:<the first N of them>`` instead. DeepSpeed's launcher ignores ``CUDA_VISIBLE_DEVICES``
    when ``--num_gpus`` is given and uses GPUs 0 to N-1, whichever the user chose (upstream's
    scripts do the same); fewer ids than N is one :class:`UserError` line. Left as it is on the CPU
    accelerator, with a hostfile, or with ids that are not numbers (GPU UUIDs)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [part.strip() for part in visible.split(",") if part.strip()]
    if (launcher.num_gpus is None or hosts.hostfile is not None or accelerator == "cpu" or not ids
            or not all(part.isdigit() for part in ids)):
        return launcher
    if len(ids) < launcher.num_gpus:
        raise UserError(f"--num_gpus {launcher.num_gpus} but CUDA_VISIBLE_DEVICES={visible} shows {len(ids)} GPU(s); "
                        "show more, or lower --num_gpus")
    # One node: --num_nodes (1) goes too, which DeepSpeed's launcher refuses beside --include.
    return replace(launcher, num_gpus=None, num_nodes=None, include=f"localhost:{','.join(ids[:launcher.num_gpus])}")


def check_multi_node_sources(environ: Mapping[str, str], cwd: str) -> None:
    """Refuse, in one line, what DeepSpeed's multi-node runner hands every rank unchecked: the working
    directory, first on every rank's ``PYTHONPATH`` (any import, ``--reward_fn m:f`` too, may load code
    from it), must be the user's or root's; the ``.deepspeed_env`` files it reads (``~/``, ``./``,
    ``$DS_ENV_FILE``: their lines become ``export`` commands of every rank) the user's own. Nobody
    else may write to them or a folder above them (:func:`dschat.runtime.trust.untrusted_reason`)."""
    reason = untrusted_reason(cwd, root_may_own=True)
    if reason is not None:
        raise UserError(f"the working directory {cwd} is not safe for a multi-node launch: {reason}; DeepSpeed "
                        "puts it first on PYTHONPATH on every node, so any module there could be imported; cd to "
                        "a folder of your own that others cannot write to")
    for path in user_env_files(environ, cwd):
        reason = untrusted_reason(path)
        if reason is not None:
            raise UserError(f"{path} is not safe to use: {reason}; DeepSpeed turns its lines into commands "
                            "of every rank of a multi-node launch; chmod go-w it if it is yours, else delete "
                            "it or set DS_ENV_FILE to a file of your own")


def plan(
    recipe: Recipe,
    params: Mapping[str, str | None] | None = None,
    extra: Sequence[str] = (),
    *,
    unset: Sequence[str] = (),
    launcher_overrides: Mapping[str, object] | None = None,
    kind: str = "deepspeed",
    repo_root: str | os.PathLike | None = None,
    require_main: bool = True,
) -> LaunchPlan:
    """Build the command for ``recipe``; ``kind`` is ``deepspeed`` (default) or ``python``.

    ``launcher_overrides`` are the user's launcher options (``None``: not given). A multi-node
    launch is refused when a value would reach the remote shell unquoted
    (:func:`dschat.multinode.check_remote_safe`).
    """
    root = find_repo_root(repo_root)
    main_py = root / recipe.step.main_py
    if require_main and not main_py.is_file():
        raise UserError(f"{main_py} does not exist; this checkout has no {recipe.step.title} step script yet")
    flags = recipe.render(params, extra, unset)
    env = {"PYTHONUNBUFFERED": "1", **recipe.env}
    # The step scripts import dschat: make it this checkout's, like the checkout's main.py, even when
    # another copy is installed (the shell recipes do the same).
    existing = os.environ.get("PYTHONPATH")
    env_set = {"PYTHONPATH": str(root) + (os.pathsep + existing if existing else "")}
    hosts = None
    needed: dict[str, str] = {}
    withheld: list[str] = []
    if kind == "deepspeed":
        launcher, hosts = resolve_launcher(recipe, launcher_overrides)
        argv = [*deepspeed_executable(), *launcher.argv(), str(main_py), *flags]
        # Every rank of this launch, and no other job's, knows it: a rank other than 0 stops early
        # when the store at the master port is not this launch's (dschat.runtime.dist).
        env_set[RENDEZVOUS_ID_VAR] = uuid.uuid4().hex
        if hosts.multi_node:
            cwd = os.getcwd()
            check_multi_node_sources(os.environ, cwd)
            # PDSH's remote command: "export K=V; ...; cd <cwd>; <python> -u -m deepspeed.launcher.launch
            # ... <main.py> <flags>", one shell string.
            withheld = sorted({*forwarded_secrets(os.environ), *secret_env_lines(os.environ, cwd),
                               *secret_rank_values(os.environ)})
            check_remote_safe([("the working directory", cwd), ("the step script", str(main_py)),
                               ("PYTHONPATH", env_set["PYTHONPATH"]), *flag_values(flags),
                               *((("--master_addr", launcher.master_addr),) if launcher.master_addr else ())])
            # The variables DeepSpeed's runner forwards by itself go into that string too, as export K=V
            # (double-quoted only when they hold a space): $(...) in one would run on every node.
            check_forwarded_env((k, v) for k, v in sorted(os.environ.items()) if k.startswith(DEEPSPEED_FORWARDS)
                                and k not in withheld and k != "PYTHONPATH")  # PYTHONPATH: the launch's own
            needed = rank_env_additions({**rank_env(os.environ, env), RENDEZVOUS_ID_VAR: env_set[RENDEZVOUS_ID_VAR]},
                                        os.environ, cwd)
    elif kind == "python":
        # Plain `python main.py` (one process, no launcher): what upstream could not do.
        argv = [sys.executable, str(main_py), *flags]
    else:
        raise UserError(f"unknown launcher kind {kind!r}; use deepspeed or python")
    out = flag_value(flags, "output_dir")  # "~" expanded as the step expands it (the log goes beside the model)
    return LaunchPlan(recipe, argv, env, Path(user_path(out)) if out else None, main_py, env_set, hosts, needed,
                      withheld)


# -------------------------------------------------------------------------------------------------
# Running: tee to the terminal and to training.log
# -------------------------------------------------------------------------------------------------
@dataclass
class LaunchResult:
    returncode: int
    seconds: float
    oom: str | None
    log_path: Path | None
    tail: str
    refused: bool = False  # exit 2 before the step started up: it refused its input, wrote nothing


def run(
    launch: LaunchPlan,
    *,
    sink: Callable[[bytes], None] | None = None,
    log: bool = True,
    tail_bytes: int = 64 * 1024,
) -> LaunchResult:
    """Run the plan; stream its merged stdout/stderr to ``sink`` (the terminal) and the log. A terminal
    whose reader goes away (``| head``) stops being written; the step and its log go on
    (:class:`~dschat.launch_log.TerminalSink`).

    Returns the exit code (``128 + signal`` when the process died of a signal, as a shell reports
    it), the wall time, and an out-of-memory diagnosis when the run failed like one. A step that refused
    its input (exit 2 before it started up) leaves no log: the output folder is as it was.
    """
    sink = TerminalSink(sink or terminal_writer())
    env = dict(os.environ)
    for key, value in launch.env.items():
        env.setdefault(key, value)  # a value the user set wins over the recipe's
    env.update(launch.env_set)
    for name in launch.withheld:
        env.pop(name, None)
    # Multi-node: always the launch's own copy, so the user's files reach the ranks only as checked.
    multi_node = launch.hosts is not None and launch.hosts.multi_node
    tee = LogTee(launch.log_path) if log and launch.log_path is not None else None
    stamp = {STARTED_FILE_VAR: str(tee.started)} if tee else {}  # the step creates it when it starts up
    env.update(stamp)
    env_file = write_rank_env_file({**launch.rank_env, **stamp}, os.environ, os.getcwd()) if multi_node else None
    if env_file is not None:
        env[ENV_FILE_VAR] = str(env_file)  # absolute: DeepSpeed reads it instead of ~/ and ./.deepspeed_env
    header = f"{PREFIX} {launch.command_line()}\n".encode()
    if env_file is not None and launch.rank_env:
        header += (f"{PREFIX} the ranks on other hosts get {', '.join(launch.rank_env)} through "
                   f"{env_file} ({ENV_FILE_VAR})\n").encode()
    if launch.withheld:
        header += (f"{PREFIX} not forwarded to the ranks (secret-looking names, or URLs with a user, password or query; "
                   f"DeepSpeed would put them on the ssh command line): {', '.join(launch.withheld)}\n").encode()
    sink(header)
    if tee:
        tee.write(header)
    tail = bytearray()
    redact = Redactor(launch.argv)  # DeepSpeed's launcher echoes the command, a URL's password too
    start = time.monotonic()
    try:
        proc = subprocess.Popen(launch.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, bufsize=0)
    except OSError as err:  # nothing ran: the folder is left as it was
        if tee:
            tee.close(discard=True)
        if env_file is not None:
            shutil.rmtree(env_file.parent, ignore_errors=True)
        where = (f" (${LAUNCHER_ENV}; unset it or name an executable there)" if os.environ.get(LAUNCHER_ENV)
                 else "")
        raise UserError(f"cannot run {launch.argv[0]}: {err.strerror or err}{where}") from None
    assert proc.stdout is not None
    interrupts = 0
    try:
        fd = proc.stdout.fileno()
        while True:
            try:
                read = os.read(fd, 65536)
                chunk = redact.feed(read) if read else redact.flush()  # at the end: what it held back
                sink(chunk)
                if tee:
                    tee.write(chunk)
                tail += chunk
                if len(tail) > tail_bytes:
                    del tail[: len(tail) - tail_bytes]
                if not read:
                    break
            except KeyboardInterrupt:
                # The child got the same Ctrl-C (same process group) and shuts down; keep draining
                # its last words. A second Ctrl-C terminates it, a third kills it.
                interrupts += 1
                if interrupts == 2:
                    proc.terminate()
                elif interrupts > 2:
                    proc.kill()
        returncode = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        # exit 2 before the step started up: it refused its input and did nothing
        refused = proc.returncode == EXIT_USAGE and not (tee and tee.started.exists())
        if tee:
            tee.close(discard=refused)
            tee.started.unlink(missing_ok=True)
        if env_file is not None:
            shutil.rmtree(env_file.parent, ignore_errors=True)
    if returncode < 0:
        returncode = 128 - returncode
    if interrupts and returncode == 0:
        returncode = 130
    text = tail.decode("utf-8", errors="replace")
    return LaunchResult(returncode, time.monotonic() - start, detect_oom(text, returncode),
                        launch.log_path if tee and not refused else None, text, refused)


# -------------------------------------------------------------------------------------------------
# CLI
# -------------------------------------------------------------------------------------------------
def _split_argv(argv: Sequence[str]) -> tuple[list[str], list[str] | None, list[str]]:
    """(launcher args, script args or None, extra main.py args after ``--``)."""
    argv = list(argv)
    if "--script-args" in argv:
        i = argv.index("--script-args")
        return argv[:i], argv[i + 1:], []
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], None, argv[i + 1:]
    return argv, None, []


def _take_launcher_flags(tokens: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Pull ``--hostfile F``, ``--master_addr A``, ``--master_port P``, ``--num_nodes N`` and
    ``--num_gpus N`` (also ``--name=value``) out of a shell script's arguments: they are the
    launcher's, the rest is for ``main.py`` (which has no flag of those names)."""
    found: dict[str, str] = {}
    rest: list[str] = []
    tokens = list(tokens)
    i = 0
    while i < len(tokens):
        name, eq, value = tokens[i].partition("=")
        if name.startswith("--") and name[2:] in LAUNCHER_FLAGS:
            if not eq:
                if i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
                    raise UserError(f"{name} needs a value")
                value = tokens[i + 1]
                i += 1
            found[name[2:]] = value
        else:
            rest.append(tokens[i])
        i += 1
    return found, rest


def _split_script_args(recipe: Recipe, tokens: Sequence[str]) -> tuple[list[str], list[str]]:
    """Positionals (up to the step's count, stopping at the first ``--flag``) and extra flags."""
    positionals: list[str] = []
    rest = list(tokens)
    while rest and len(positionals) < len(recipe.step.params) and not rest[0].startswith("--"):
        positionals.append(rest.pop(0))
    if rest and not rest[0].startswith("--"):
        split_flag_groups(rest)  # raises the readable "must be flags" error
    return positionals, rest


def _launcher_values(found: Mapping[str, str]) -> dict[str, object]:
    """Launcher flags given as text (a shell script's arguments) with their types; ``--hostfile=~/h``
    expanded as the parser's ``--hostfile`` (bash leaves a ``~`` after ``=`` as it is)."""
    out: dict[str, object] = {}
    for name, value in found.items():
        if name in ("master_port", "num_nodes", "num_gpus"):
            try:
                out[name] = int(value)
            except ValueError:
                raise UserError(f"--{name} must be an integer, got {value!r}") from None
        else:
            out[name] = user_path(value) if name == "hostfile" else value
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dschat.launch",
        description="Run one training step from a recipe in configs/ through the deepspeed launcher.",
        epilog="Everything after `--` is added to main.py's flags (a flag the recipe also sets is replaced). "
               "List recipes with: python -m dschat.recipes list",
    )
    parser.add_argument("step", help="step1, step2, dpo or step3 (also 1, 2, 3)")
    parser.add_argument("recipe", help="recipe id, e.g. opt/single_gpu/1.3b or cpu/smollm2-135m")
    params = parser.add_argument_group("recipe parameters (upstream's positionals; default: the recipe's)")
    params.add_argument("--output_dir", type=user_path, default=None, help="steps 1, 2, DPO: $1; step 3: $5")
    params.add_argument("--zero_stage", default=None, help="steps 1, 2, DPO: $2")
    params.add_argument("--actor_model", type=user_path, default=None, help="step 3: $1, the step-1 output")
    params.add_argument("--critic_model", type=user_path, default=None, help="step 3: $2, the step-2 output")
    params.add_argument("--actor_zero_stage", default=None, help="step 3: $3")
    params.add_argument("--critic_zero_stage", default=None, help="step 3: $4")
    launch = parser.add_argument_group("launcher (default: the recipe's)")
    launch.add_argument("--num_gpus", type=int, default=None, help="deepspeed --num_gpus")
    launch.add_argument("--num_nodes", type=int, default=None, help="deepspeed --num_nodes")
    launch.add_argument("--hostfile", type=user_path, default=None, help="deepspeed --hostfile (multi-node; default /job/hostfile)")
    launch.add_argument("--master_port", type=int, default=None,
                        help="deepspeed --master_port (default: a free port on one node; on several nodes the "
                             "recipe's port or 29500, which must be free on the first host)")
    launch.add_argument("--master_addr", default=None,
                        help="deepspeed --master_addr: the first host's address that the others reach (default: "
                             "the launcher asks the first host with `hostname -I` and takes the first address)")
    launch.add_argument("--launcher", choices=("deepspeed", "python"), default="deepspeed",
                        help="'python' runs main.py in this process's interpreter without the launcher")
    launch.add_argument("--unset", action="append", default=[], metavar="FLAG",
                        help="drop a recipe flag, e.g. --unset enable_hybrid_engine (repeatable)")
    launch.add_argument("--no-log", action="store_true", help="do not write OUTPUT/training.log")
    launch.add_argument("--dry-run", action="store_true", help="print the command and exit")
    launch.add_argument("--repo-root", default=None, help="the dschat checkout (default: found automatically)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, plan, run; return the step's exit code (2 for bad input via :func:`cli_main`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own, script_args, extra = _split_argv(argv)
    args = build_parser().parse_args(own)
    recipe = get_recipe(args.step, args.recipe, args.repo_root)
    param_names = recipe.step.params
    given = {name: getattr(args, name) for name in ("output_dir", "zero_stage", "actor_model", "critic_model",
                                                      "actor_zero_stage", "critic_zero_stage")}
    wrong = [name for name, value in given.items() if value is not None and name not in param_names]
    if wrong:
        raise UserError(f"{recipe.label} takes {', '.join('--' + p for p in param_names)}, not "
                        f"{', '.join('--' + w for w in wrong)}")
    params = {name: given[name] for name in param_names}
    launcher: dict[str, object] = {"num_gpus": args.num_gpus, "num_nodes": args.num_nodes, "hostfile": args.hostfile,
                                   "master_addr": args.master_addr, "master_port": args.master_port}
    if script_args is not None:
        script_launcher, script_args = _take_launcher_flags(script_args)
        launcher.update(_launcher_values(script_launcher))
        positionals, extra = _split_script_args(recipe, script_args)
        for name, value in recipe.params_from_positionals(positionals).items():
            if value:
                params[name] = value
    ignored = [f"--{name}" for name, value in launcher.items() if value is not None]
    if args.launcher == "python" and ignored:
        raise UserError(f"--launcher python runs main.py as one process here; {', '.join(ignored)} are the deepspeed "
                        "launcher's options: drop them or use --launcher deepspeed")
    launch = plan(recipe, params, extra, unset=args.unset, launcher_overrides=launcher, kind=args.launcher,
                  repo_root=args.repo_root, require_main=not args.dry_run)
    if args.dry_run:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in launch.env.items() if k != "PYTHONUNBUFFERED")
        print(f"{env} {launch.command_line()}" if env else launch.command_line())
        return 0
    if launch.log_path is not None and not args.no_log:
        check_writable_dir(launch.log_path.parent, "--output_dir")  # before the log creates it
    result = run(launch, log=not args.no_log)
    if result.returncode != 0:
        where = f"; log: {result.log_path}" if result.log_path else ""
        print(f"{PREFIX} {recipe.step.key} exited with status {result.returncode}{where}", file=sys.stderr)
        if result.oom:
            cpu = launch.env.get("DS_ACCELERATOR") == "cpu" or os.environ.get("DS_ACCELERATOR") == "cpu"
            print(f"{PREFIX} looks like out of memory: {result.oom}\n{oom_advice(recipe.step, cpu=cpu)}",
                  file=sys.stderr)
    return result.returncode


def _entry(argv: Sequence[str] | None = None) -> int:
    code: list[int] = [0]

    def wrapped(a: Sequence[str] | None) -> None:
        code[0] = main(a)

    usage = cli_main(wrapped, argv)
    return usage if usage else code[0]


if __name__ == "__main__":
    raise SystemExit(_entry())
