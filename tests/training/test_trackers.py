"""Experiment trackers (``--report_to``; dschat/training/trackers.py): the flag, a missing extra,
a tracker failing mid-run, and tiny step-1 and step-3 runs read back from an offline W&B run and a
file-store MLflow run."""
from __future__ import annotations

import argparse
import math
import sys

import pytest

from dschat.cli.shared import add_step1_args
from dschat.cli.step3 import add_step3_args
from dschat.errors import EXIT_USAGE, UserError, cli_main
from dschat.rlhf.ppo_loop import tensorboard_scalars
from dschat.training.trackers import Trackers, trackers_of

from helpers.step3 import base_argv as step3_argv, step3_main
from helpers.steps import base_argv, load_script
from helpers.trackers import clean_tracker_env, mlflow_run, mlflow_series, read_wandb_run



@pytest.fixture(autouse=True)
def tracker_env(monkeypatch, tmp_path):
    clean_tracker_env(monkeypatch, tmp_path / "home")


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


# ------------------------------------------------------------------------------------ the flag


@pytest.mark.parametrize("add_args,required", [(add_step1_args, ["--model_name_or_path", "m"]),
                                               (add_step3_args, ["--actor_model_name_or_path", "m"])])
def test_report_to_lists_trackers_and_enable_tensorboard_is_tensorboard(add_args, required, capsys):
    parser = add_args(argparse.ArgumentParser())
    parse = lambda *flags: parser.parse_args([*required, *flags])  # noqa: E731

    assert trackers_of(parse()) == ()  # upstream's default: nothing
    assert trackers_of(parse("--enable_tensorboard")) == ("tensorboard",)
    assert trackers_of(parse("--report_to", "mlflow, wandb,mlflow")) == ("mlflow", "wandb")
    assert trackers_of(parse("--report_to", "none")) == ()
    assert trackers_of(parse("--report_to", "wandb", "--enable_tensorboard")) == ("tensorboard", "wandb")
    # --report_to tensorboard is --enable_tensorboard: DeepSpeed's monitor and the path check follow it.
    assert parse("--report_to", "tensorboard,mlflow").enable_tensorboard
    assert not parse("--report_to", "wandb").enable_tensorboard
    for wrong in ("comet", "wandb,none", ""):
        with pytest.raises(SystemExit) as exit_info:
            parse("--report_to", wrong)
        assert exit_info.value.code == EXIT_USAGE
        assert "give a comma list of tensorboard, wandb, mlflow, or none" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ a missing extra


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_missing_extra_is_one_line_naming_it_before_any_model(tracker, monkeypatch, tmp_path, capsys):
    """The import fails as it does when the package is absent; step 1 stops with exit 2 before it
    reads data or builds a model."""
    step1 = load_script("step1")
    monkeypatch.setitem(sys.modules, tracker, None)  # what an import finds when the package is absent

    def no_data(*args, **kwargs):
        raise AssertionError("data and models are loaded after the trackers are checked")

    monkeypatch.setattr(step1, "build_step_data", no_data)
    argv = base_argv("tiny-opt", tmp_path / "data", "--output_dir", str(tmp_path / "out"), "--report_to", tracker)
    assert cli_main(step1.main, argv) == EXIT_USAGE
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"--report_to {tracker} needs the {tracker} extra" in lines[0]
    assert f"pip install 'dschat[{tracker}]'" in lines[0]
    assert not (tmp_path / "out").exists()


def test_without_the_extras_tensorboard_alone_runs(monkeypatch, tmp_path):
    """Neither extra installed: the module imports and TensorBoard (upstream's --enable_tensorboard) logs."""
    import importlib

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import dschat.training.trackers as trackers_module

    for name in ("wandb", "mlflow"):
        monkeypatch.setitem(sys.modules, name, None)
    module = importlib.reload(trackers_module)
    args = add_step1_args(argparse.ArgumentParser()).parse_args(
        ["--model_name_or_path", "m", "--enable_tensorboard", "--tensorboard_path", str(tmp_path / "tb")])
    trackers = module.Trackers.from_args(args, "step1_model_dschat", run_name="step1")
    trackers.scalars(1, **{"train/loss": 2.5})
    trackers.close()
    events = EventAccumulator(str(tmp_path / "tb" / "step1_model_dschat")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 2.5)]


# ------------------------------------------------------------------------------------ failing mid-run


@pytest.mark.parametrize("failing", ["wandb", "mlflow"])
def test_a_tracker_failing_mid_run_warns_once_and_the_others_go_on(failing, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = Trackers(["tensorboard", "wandb", "mlflow"], str(tmp_path / "tb"), "run", run_name="unit",
                        config={"learning_rate": 0.1, "data_path": ["a", "b"]}, root=str(tmp_path / "out"))
    sink = next(s for s in trackers.sinks if s.label == {"wandb": "W&B", "mlflow": "MLflow"}[failing])
    calls = []

    def broken(step, values):
        calls.append(step)
        raise OSError("disk quota exceeded\nsecond line")

    trackers.scalars(0, loss=3.0)
    sink.log = broken
    for step in (1, 2, 3):
        trackers.scalars(step, loss=3.0 - step)
    trackers.close()

    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("WARNING:")]
    assert warnings == [f"WARNING: {sink.label} logging failed at step 1 (OSError: disk quota exceeded); "
                        f"the run goes on without {sink.label}"], err
    assert calls == [1]  # dropped after its failure
    events = EventAccumulator(str(tmp_path / "tb" / "run")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(0, 3.0), (1, 2.0), (2, 1.0), (3, 0.0)]
    wandb_rows = [(r["global_step"], r["loss"]) for r in read_wandb_run(tmp_path / "out").history]
    client, run = mlflow_run(tmp_path / "out" / "mlruns", "unit")
    logged = {"wandb": wandb_rows, "mlflow": mlflow_series(client, run, "loss")}
    assert logged[failing] == [(0, 3.0)]
    for other, rows in logged.items():
        if other != failing:
            assert rows == [(0, 3.0), (1, 2.0), (2, 1.0), (3, 0.0)], other
    assert run.data.params == {"learning_rate": "0.1", "data_path": "['a', 'b']"}


def test_an_mlflow_server_that_fails_a_log_is_not_asked_again(monkeypatch, tmp_path, capsys):
    """Against a tracking server: each call is bounded (MLflow's HTTP limits, unless the user set
    one), and after a failed log the server is not asked to end the run."""
    import json
    import os
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from dschat.training.trackers import MLFLOW_HTTP_LIMITS

    paths: list[str] = []

    class Server(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            paths.append(self.path)
            self._answer(200, {"experiment": {"experiment_id": "1", "name": "dschat"}})

        def do_POST(self):
            paths.append(self.path)
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path.endswith("runs/create"):
                self._answer(200, {"run": {"info": {"run_id": "r1", "experiment_id": "1", "status": "RUNNING",
                                                    "start_time": 0, "lifecycle_stage": "active"}, "data": {}}})
            elif body.get("metrics"):
                self._answer(400, {"error_code": "INVALID_PARAMETER_VALUE", "message": "metrics refused"})
            else:
                self._answer(200, {})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")  # the user's own setting wins
        trackers = Trackers(["mlflow"], str(tmp_path / "tb"), "run", run_name="served", root=str(tmp_path / "out"))
        assert {name: os.environ[name] for name in MLFLOW_HTTP_LIMITS} == {
            **MLFLOW_HTTP_LIMITS, "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
        trackers.scalars(1, loss=1.0)
        assert trackers.sinks == []
        trackers.close()
    finally:
        server.shutdown()
        server.server_close()
    assert "WARNING: MLflow logging failed at step 1" in capsys.readouterr().err
    assert any(path.endswith("runs/log-batch") for path in paths), paths
    assert not any(path.endswith("runs/update") for path in paths), paths  # set_terminated was not asked


def test_mlflow_gets_a_judge_named_by_any_folder_path(tmp_path, monkeypatch):
    """``eval/judge/<--eval_judge>`` of an absolute, ``./``, ``../`` or trailing-slash folder is a name
    MLflow refuses as it stands (it normalises to another path), which dropped the whole MLflow sink at
    the first evaluation. Each is logged under a plain relative path, beside the other scalars."""
    trackers = Trackers(["mlflow"], str(tmp_path / "tb"), "run", run_name="judges", root=str(tmp_path))
    trackers.scalars(0, loss=1.0, **{"eval/judge//data/rm": 0.5, "eval/judge/./rm": 0.25,
                                    "eval/judge/../rm/": 0.125})
    assert [type(sink).__name__ for sink in trackers.sinks] == ["_MlflowSink"]
    trackers.close()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the run set it for itself
    client, run = mlflow_run(tmp_path / "mlruns", "judges")
    assert run.info.status == "FINISHED"
    assert {name: mlflow_series(client, run, name) for name in
            ("loss", "eval/judge/data/rm", "eval/judge/_/rm", "eval/judge/__/rm")} == {
        "loss": [(0, 1.0)], "eval/judge/data/rm": [(0, 0.5)], "eval/judge/_/rm": [(0, 0.25)],
        "eval/judge/__/rm": [(0, 0.125)]}


def test_a_tracker_that_cannot_start_is_one_line_naming_its_store(monkeypatch, tmp_path):
    """The line names the store that failed: MLFLOW_TRACKING_URI when set (without its password), not
    --output_dir."""
    store = "sqlite:///" + str(tmp_path / "no-such-folder" / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    with pytest.raises(UserError) as caught:
        Trackers(["mlflow"], str(tmp_path / "tb"), "run", root=str(tmp_path / "out"))
    assert str(caught.value).startswith(f"--report_to mlflow: MLflow could not start a run in MLFLOW_TRACKING_URI "
                                        f"{store} (")
    assert str(caught.value).endswith("; fix its settings or drop it from --report_to")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://user:secret@127.0.0.1:9/?token=t")  # nothing listens on 9
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # refused at once: no retries to wait for
    with pytest.raises(UserError) as caught:
        Trackers(["mlflow"], str(tmp_path / "tb"), "run", root=str(tmp_path / "out"))
    assert "could not start a run in MLFLOW_TRACKING_URI http://***@127.0.0.1:9/?*** (" in str(caught.value)
    assert "secret" not in str(caught.value)


def test_a_run_started_before_another_tracker_failed_to_start_ends_failed(monkeypatch, tmp_path):
    """MLflow's run had started when W&B could not: nothing was trained, so it must not read FINISHED."""
    monkeypatch.setenv("WANDB_MODE", "bogus")  # W&B refuses it when its run starts
    with pytest.raises(UserError, match=r"^--report_to wandb: W&B could not start a run"):
        Trackers(["mlflow", "wandb"], str(tmp_path / "tb"), "run", run_name="first", root=str(tmp_path))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the run set it for itself
    _, run = mlflow_run(tmp_path / "mlruns", "first")
    assert run.info.status == "FAILED"


def test_an_unwritable_wandb_dir_is_one_line_before_any_model(monkeypatch, tmp_path, capsys):
    """WANDB_DIR under a regular file: W&B alone would fall back to a temporary folder and the run
    would go on; step 1 stops with one line naming WANDB_DIR, exit 2, before it reads data."""
    step1 = load_script("step1")

    def no_data(*args, **kwargs):
        raise AssertionError("data and models are loaded after the trackers are checked")

    monkeypatch.setattr(step1, "build_step_data", no_data)
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "a-file" / "wandb"))
    argv = base_argv("tiny-opt", tmp_path / "data", "--output_dir", str(tmp_path / "out"), "--report_to", "wandb")
    assert cli_main(step1.main, argv) == EXIT_USAGE
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert lines == [f"error: WANDB_DIR {tmp_path / 'a-file' / 'wandb'} cannot be created: {tmp_path / 'a-file'} is "
                     "a file, not a folder; pass a path under a folder"] and "Traceback" not in err, err


def test_a_wandb_dir_that_does_not_exist_yet_is_made(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "new" / "wandb-runs"))
    trackers = Trackers(["wandb"], str(tmp_path / "tb"), "run", run_name="unit", root=str(tmp_path / "out"))
    trackers.scalars(0, loss=1.0)
    trackers.close()
    assert read_wandb_run(tmp_path / "new" / "wandb-runs").history == [{"global_step": 0, "loss": 1.0}]


# ------------------------------------------------------------------------------------ resume


def test_a_resumed_run_hides_the_earlier_attempts_later_steps_in_tensorboard(tmp_path):
    """An attempt logs steps 0-2 and stops; the run resumes from a checkpoint at step 2 and logs 2-3 in
    the same folder: TensorBoard shows each step once, the resumed run's value from step 2 on."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = Trackers(["tensorboard"], str(tmp_path / "tb"), "run")
    for step in (0, 1, 2):
        first.scalars(step, loss=10.0 + step, other=1.0)
    first.close()
    resumed = Trackers(["tensorboard"], str(tmp_path / "tb"), "run")
    resumed.resume_at(2)
    for step in (2, 3):
        resumed.scalars(step, loss=20.0 + step)
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tb" / "run")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(0, 10.0), (1, 11.0), (2, 22.0), (3, 23.0)]
    assert [e.step for e in events.Scalars("other")] == [0, 1]  # a tag the resumed run does not log: cut too
    Trackers([], str(tmp_path / "tb"), "none").resume_at(2)  # no TensorBoard: nothing to do


def test_an_mlflow_run_whose_process_dies_before_close_ends_failed(tmp_path, monkeypatch):
    """A step that stops with an error after its trackers started leaves no MLflow run RUNNING."""
    import os
    import subprocess

    code = ("from dschat.training.trackers import Trackers\n"
            f"t = Trackers(['mlflow'], {str(tmp_path / 'tb')!r}, 'run', run_name='crash', root={str(tmp_path)!r})\n"
            "t.scalars(0, loss=1.0)\n"
            "raise SystemExit('error: data went missing')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "data went missing" in done.stderr, done.stderr[-2000:]
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the run set it for itself
    client, run = mlflow_run(tmp_path / "mlruns", "crash")
    assert run.info.status == "FAILED" and mlflow_series(client, run, "loss") == [(0, 1.0)]


def test_an_mlflow_run_whose_process_is_stopped_by_sigterm_ends_killed(tmp_path, monkeypatch):
    """A single-process run stopped by SIGTERM: its MLflow run ends KILLED and the process still ends
    by that signal; a forked child stopped by SIGTERM leaves the run RUNNING; a run closed before the
    signal stays FINISHED."""
    import os
    import signal
    import subprocess

    code = ("import sys, time\n"
            "from dschat.training.trackers import Trackers\n"
            f"done = Trackers(['mlflow'], {str(tmp_path / 'tb')!r}, 'run', run_name='done', root={str(tmp_path)!r})\n"
            "done.close()\n"
            f"t = Trackers(['mlflow'], {str(tmp_path / 'tb')!r}, 'run', run_name='stopped', root={str(tmp_path)!r})\n"
            "t.scalars(0, loss=1.0)\n"
            "import os, signal\n"
            "child = os.fork()\n"  # a worker process inherits the handler: its SIGTERM leaves the run alone
            "if child == 0:\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    os._exit(3)\n"
            "_, status = os.waitpid(child, 0)\n"
            "sink = t.sinks[0]\n"
            "print(os.WTERMSIG(status), sink.client.get_run(sink.run_id).info.status, flush=True)\n"
            "print('ready', flush=True)\n"
            "time.sleep(300)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().split() == [str(int(signal.SIGTERM)), "RUNNING"], proc.stderr.read()[-2000:]
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-2000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the run set it for itself
    client, run = mlflow_run(tmp_path / "mlruns", "stopped")
    assert run.info.status == "KILLED" and mlflow_series(client, run, "loss") == [(0, 1.0)]
    assert mlflow_run(tmp_path / "mlruns", "done")[1].info.status == "FINISHED"


# ------------------------------------------------------------------------------------ whole steps


@pytest.mark.slow
def test_step1_reports_to_mlflow_alone(tmp_path):
    step1 = load_script("step1")
    out, tb = tmp_path / "out", tmp_path / "tb"
    result = step1.main(base_argv("tiny-opt", tmp_path / "data", "--output_dir", str(out), "--report_to", "mlflow",
                                  "--tensorboard_path", str(tb), max_train_steps=3))

    client, run = mlflow_run(out / "mlruns", "step1")
    assert run.info.status == "FINISHED"
    assert len(mlflow_series(client, run, "train/loss")) == 3
    assert [step for step, _ in mlflow_series(client, run, "train/loss")] == [1, 2, 3]
    assert mlflow_series(client, run, "eval/ppl") == [(e["step"], pytest.approx(e["ppl"])) for e in result.evals]
    assert mlflow_series(client, run, "eval/loss") == [(e["step"], pytest.approx(e["loss"])) for e in result.evals]
    params = run.data.params
    assert params["model_name_or_path"] == "tiny-opt" and params["max_train_steps"] == "3"
    assert params["report_to"] == "['mlflow']" and params["enable_tensorboard"] == "False"
    assert not tb.exists()  # mlflow alone: no TensorBoard files
    assert not (out / "wandb").exists()


@pytest.mark.slow
@pytest.mark.parametrize("step,run_name,evals", [
    ("step2", "step2", ("eval/chosen_score", "eval/rejected_score", "eval/acc", "eval/loss")),
    ("dpo", "step2_dpo", ("eval/chosen_reward", "eval/rejected_reward", "eval/acc", "eval/loss")),
])
def test_steps_2_and_dpo_report_to_wandb(step, run_name, evals, tmp_path):
    out = tmp_path / "out"
    result = load_script(step).main(base_argv("tiny-opt", tmp_path / "data", "--output_dir", str(out),
                                              "--report_to", "wandb", max_train_steps=2))
    run = read_wandb_run(out)
    assert run.exited and run.config["model_name_or_path"] == "tiny-opt"
    losses = [(row["global_step"], row["train/loss"]) for row in run.history if "train/loss" in row]
    assert [step for step, _ in losses] == [1, 2] and all(math.isfinite(loss) for _, loss in losses)
    evaluated = [row for row in run.history if "eval/acc" in row]
    assert [row["global_step"] for row in evaluated] == [e["step"] for e in result.evals] == [0, 2]
    assert all(set(evals) <= set(row) for row in evaluated), evaluated
    assert not (out / "mlruns").exists()  # wandb alone


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_step3_writes_the_same_scalars_to_wandb_and_mlflow(critic_dirs, data_cache, tmp_path):
    out = tmp_path / "out"
    argv = step3_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--output_dir", str(out),
                      "--report_to", "wandb,mlflow", "--enable_tensorboard", "--tensorboard_path", str(tmp_path / "tb"))
    result = step3_main().main(argv)
    assert len(result.history) == 2
    expected = [tensorboard_scalars(record) for record in result.history]  # metrics.jsonl's scalars

    wandb_run = read_wandb_run(out)
    assert wandb_run.exited
    assert [row["global_step"] for row in wandb_run.history] == [0, 1]
    for row, scalars in zip(wandb_run.history, expected):
        assert set(row) == {"global_step", *scalars}, row
        wrong = {k: (row[k], v) for k, v in scalars.items() if not _same(float(row[k]), v)}
        assert not wrong, wrong
    assert wandb_run.config["actor_model_name_or_path"] == "tiny-opt"
    assert wandb_run.config["report_to"] == ["wandb", "mlflow"] and wandb_run.config["test_stop_step"] == 2

    client, run = mlflow_run(out / "mlruns", "step3")
    assert run.info.status == "FINISHED"
    assert set(run.data.metrics) == set(expected[0])
    for key in expected[0]:
        series = mlflow_series(client, run, key)
        assert [step for step, _ in series] == [0, 1], key
        assert all(_same(value, scalars[key]) for (_, value), scalars in zip(series, expected)), (key, series)
    assert run.data.params["actor_model_name_or_path"] == "tiny-opt"
    assert run.data.params["critic_model_name_or_path"] == str(critic_dirs["tiny-opt"])
    # TensorBoard still gets them, beside.
    assert (tmp_path / "tb" / "step3_tensorboard_logs").is_dir()


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_resumed_step3_run_shows_each_iteration_once_in_tensorboard(critic_dirs, data_cache, tmp_path):
    """Iterations 0-2 with a checkpoint after 2, then --resume from it to 4 iterations: metrics.jsonl
    and TensorBoard both hold iterations 0-3 once each, the resumed run's from 2 on."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, tb = tmp_path / "out", tmp_path / "tb"

    def argv(steps: int, *extra: str) -> list[str]:
        return step3_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--output_dir", str(out), "--save_interval",
                          "2", "--enable_tensorboard", "--tensorboard_path", str(tb), *extra, steps=steps)

    first = step3_main().main(argv(3))
    resumed = step3_main().main(argv(4, "--resume"))
    assert [r["global_step"] for r in first.history] == [0, 1, 2]
    assert [r["global_step"] for r in resumed.history] == [2, 3]
    kept = [tensorboard_scalars(r) for r in first.history[:2] + resumed.history]
    events = EventAccumulator(str(tb / "step3_tensorboard_logs")).Reload()
    for key in ("time/generation", "time/training"):  # differ between the attempts
        shown = events.Scalars(key)
        assert [e.step for e in shown] == [0, 1, 2, 3], key
        assert all(_same(e.value, scalars[key]) for e, scalars in zip(shown, kept)), key


@pytest.mark.usefixtures("one_thread")
def test_a_resumed_step1_run_shows_each_optimizer_step_once_in_tensorboard(tmp_path):
    """Steps 1-3 with a checkpoint after 2, then --resume from it to 4 steps: TensorBoard's train/loss
    holds steps 1-4 once each, the resumed run's from 3 on (the x of steps 1-2 is the optimizer step,
    1-based: the checkpoint's own step keeps the first attempt's point)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    main, out, tb = load_script("step1").main, tmp_path / "out", tmp_path / "tb"

    def argv(steps: int, *extra: str) -> list[str]:
        return base_argv("tiny-llama", tmp_path / "data", "--output_dir", str(out), "--save_interval", "2",
                         "--enable_tensorboard", "--tensorboard_path", str(tb), *extra, max_train_steps=steps,
                         batch_size=2)

    first = main(argv(3))
    resumed = main(argv(4, "--resume"))
    assert len(first.train_losses) == 3 and len(resumed.train_losses) == 2
    events = EventAccumulator(str(tb / "step1_model_dschat")).Reload()
    shown = events.Scalars("train/loss")
    assert [e.step for e in shown] == [1, 2, 3, 4]
    expected = first.train_losses[:2] + resumed.train_losses
    assert all(_same(e.value, loss) for e, loss in zip(shown, expected)), (shown, expected)


@pytest.mark.usefixtures("one_thread")
def test_steps_1_2_train_loss_is_the_optimizer_steps_mean_micro_batch_loss(tmp_path):
    """With --gradient_accumulation_steps 2, each optimizer step's train/loss is the mean of its two
    micro-batch losses (the last one alone was logged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    result = load_script("step1").main(base_argv(
        "tiny-llama", tmp_path / "data", "--gradient_accumulation_steps", "2", "--enable_tensorboard",
        "--tensorboard_path", str(tb), max_train_steps=2, batch_size=2))
    losses = result.train_losses
    assert len(losses) == 4 and losses[0] != losses[1]
    shown = EventAccumulator(str(tb / "step1_model_dschat")).Reload().Scalars("train/loss")
    assert [e.step for e in shown] == [1, 2]
    assert all(_same(e.value, (losses[2 * i] + losses[2 * i + 1]) / 2) for i, e in enumerate(shown)), (shown, losses)


def test_enable_tensorboard_with_report_to_tensorboard_is_one_sink():
    """Both flags name the same tracker: one TensorBoard writer, not two writing every scalar twice."""
    assert trackers_of(argparse.Namespace(report_to=["tensorboard"], enable_tensorboard=True)) == ("tensorboard",)
