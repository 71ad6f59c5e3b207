"""The command line's edges (issue #60): a configuration error exits 2 naming its flag,
``rd2h serve`` refuses a missing model in one line, keeps the user's environment and
reports an engine's failure by its root error; every command states its exit status."""

from __future__ import annotations

from pathlib import Path

import pytest

from rd2h.cli import serve
from rd2h.cli.main import build_parser, main


@pytest.mark.parametrize(("args", "says"), [
    (["--kv-port", "70000"], "--kv-port 70000: input should be less than or equal to 65535"),
    (["--kv-port", "0"], None),  # 0: free ports are picked
    (["--cma-threads", "0"], "--cma-threads 0: input should be greater than or equal to 1"),
    (["--kv-port", "65535"], "decode port plan overflows"),
])
def test_demo_configuration_errors_exit_2_naming_the_flag(args, says, capsys,
                                                          monkeypatch) -> None:
    import rd2h.demo

    ran = []
    monkeypatch.setattr(rd2h.demo, "run_demo", lambda cfg, progress: ran.append(cfg) or (
        _ for _ in ()).throw(SystemExit(0)))
    if says is None:
        with pytest.raises(SystemExit):
            main(["demo", "--quiet", *args])
        assert ran
        return
    assert main(["demo", "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and "validation error" not in err and not ran


def test_a_secret_refused_by_the_settings_is_never_echoed(capsys, monkeypatch) -> None:
    import rd2h.demo.config as config

    monkeypatch.setattr(config, "MIN_SECRET_CHARS", 1)  # let the demo's own check pass
    monkeypatch.setitem(config.SETTINGS_FLAGS, "auth_secret", "--auth-secret")
    assert main(["demo", "--quiet", "--auth-secret", "short-secret"]) == 2
    err = capsys.readouterr().err
    assert "--auth-secret" in err and "short-secret" not in err


def test_serve_refuses_a_missing_model_path_in_one_line(tmp_path: Path, capsys) -> None:
    assert main(["serve", "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not exist" in err
    (tmp_path / "file").write_text("x")
    assert serve._model_problem(str(tmp_path / "file")).endswith(
        "is not a folder (give a model folder, or a model name)")
    assert serve._model_problem(str(tmp_path)) is None
    assert serve._model_problem("meta-llama/Llama-3.1-8B") is None  # a name vLLM resolves


def test_serve_keeps_the_users_environment() -> None:
    assert serve.cpu_env({}) == serve.CPU_ENV
    mine = {"OMP_NUM_THREADS": "4", "VLLM_CPU_KVCACHE_SPACE": "8"}
    assert serve.cpu_env(mine) == {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def test_serve_names_an_engines_root_error(tmp_path: Path) -> None:
    log = tmp_path / "prefill0.log"
    log.write_text(
        "INFO 12-07 starting\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "OSError: [Errno 2] No such file or directory: '/models/x/config.json'\n"
        "\nThe above exception was the direct cause of the following exception:\n\n"
        "Traceback (most recent call last):\n"
        "\x1b[31mRuntimeError: Engine core initialization failed. See root cause above. "
        "Failed core proc(s): {}\x1b[0m\n")
    assert serve.root_error(log) == ("OSError: [Errno 2] No such file or directory: "
                                     "'/models/x/config.json'")
    log.write_text("INFO nothing wrong\n")
    assert serve.root_error(log) is None


def test_every_command_states_its_exit_status() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for p in sub.choices.values():
        targets = [p]
        nested = [a for a in p._actions if getattr(a, "choices", None) and isinstance(
            a.choices, dict)]
        if nested:
            targets = list(nested[0].choices.values())
        for t in targets:
            assert "Exit status" in (t.description or "") + (t.epilog or ""), t.prog
