"""Shell completion (Typer's own, bash/zsh/fish), the trainer's options and --model values, and
--version: all without importing torch."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from conftest import heavy_imports, run_ddprun
from ddprun import train_options
from ddprun.completion import trainer_completions




def _complete(words: str, *, env: dict) -> list[str]:
    """What the bash completion script gets back for `words` (the last one being typed)."""
    cword = len(words.split()) - (0 if words.endswith(" ") else 1)
    result = run_ddprun([], env={**env, "_DDPRUN_COMPLETE": "complete_bash", "COMP_WORDS": words,
                                 "COMP_CWORD": str(cword)}, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


@pytest.mark.parametrize("shell, line", [
    ("bash", "complete -o default -F _ddprun_completion ddprun"),
    ("zsh", "compdef _ddprun_completion ddprun"),
    ("fish", "complete --command ddprun --no-files"),
])
def test_the_completion_script_for_each_shell(shell, line, cpu_env):
    result = run_ddprun([], env={**cpu_env, "_DDPRUN_COMPLETE": f"source_{shell}"}, timeout=60)
    assert result.returncode == 0, result.stderr
    assert line in result.stdout and f"_DDPRUN_COMPLETE=complete_{shell}" in result.stdout


def test_bash_completes_commands_options_and_the_trainers_models(cpu_env):
    assert _complete("ddprun tr", env=cpu_env) == ["train"]
    assert "--max-restarts" in _complete("ddprun run --max", env=cpu_env)
    assert _complete("ddprun train --mo", env=cpu_env) == ["--model"]
    assert _complete("ddprun train --epochs 2 --model resnet1", env=cpu_env) == ["resnet18", "resnet101", "resnet152"]
    assert _complete("ddprun train --optimizer ", env=cpu_env) == list(train_options.OPTIMIZERS)


def test_a_bash_session_completes_ddprun_tr_to_train(tmp_path, cpu_env):
    """The generated script itself, sourced by bash, asked for `ddprun tr<TAB>`."""
    bash = subprocess.run(["bash", "--version"], capture_output=True)
    if bash.returncode != 0:
        pytest.skip("no bash")
    script = tmp_path / "ddprun.bash"
    script.write_text(run_ddprun([], env={**cpu_env, "_DDPRUN_COMPLETE": "source_bash"}, timeout=60).stdout)
    bindir = str(sys.executable).rsplit("/", 1)[0]
    test = (f"source {script}; COMP_WORDS=(ddprun tr); COMP_CWORD=1; _ddprun_completion ddprun; "
            "printf '%s\\n' \"${COMPREPLY[@]}\"")
    result = subprocess.run(["bash", "--norc", "-c", test], env={**cpu_env, "PATH": f"{bindir}:{cpu_env['PATH']}"},
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["train"], result.stderr


def test_trainer_completions_are_pure():
    assert ("--model", "trainer option") in trainer_completions([], "--mod")
    assert ("--no-channels-last", "trainer option") in trainer_completions([], "--no-ch")
    assert [v for v, _ in trainer_completions(["--model"], "mobilenet_v3")] == ["mobilenet_v3_small", "mobilenet_v3_large"]
    assert trainer_completions(["--epochs"], "") == []  # a number: the shell's default applies
    assert trainer_completions([], "res") == []


@pytest.mark.parametrize("args, env", [
    (["--version"], {}),
    ([], {"_DDPRUN_COMPLETE": "complete_bash", "COMP_WORDS": "ddprun train --model r", "COMP_CWORD": "3"}),
    ([], {"_DDPRUN_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": "ddprun tr"}),
])
def test_version_and_completion_never_import_torch(args, env, cpu_env):
    assert "TORCH" not in heavy_imports(args, env={**cpu_env, **env})


def test_version_prints_ddprun_torch_and_python(cpu_env):
    from importlib import metadata

    result = run_ddprun(["--version"], env=cpu_env, timeout=60)
    assert result.returncode == 0
    assert result.stdout.splitlines() == [f"ddprun {metadata.version('ddprun')}", f"torch {metadata.version('torch')}",
                                          f"Python {platform.python_version()}"]
