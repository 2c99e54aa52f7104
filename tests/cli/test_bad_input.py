"""Bad input to the training and data commands: one clear line, exit code 2, before any work starts.

`--max-steps` / `--max-iterations` must be positive (0 used to train the whole schedule, -1 to do nothing), and
a wrong type in `--set` or in a TOML file is one line naming the key, the type wanted and the value given, for
every TOML command.
"""

from __future__ import annotations

import pytest

from openk2.cli import main

CONFIGS = "configs"


@pytest.mark.parametrize("argv", [
    ["pretrain", "--config", f"{CONFIGS}/tiny.toml", "--max-steps"],
    ["sft", "--config", f"{CONFIGS}/sft-tiny.toml", "--max-steps"],
    ["rl", "--config", f"{CONFIGS}/rl-tiny.toml", "--max-iterations"],
])
@pytest.mark.parametrize("value", ["0", "-1", "abc"])
def test_step_limits_must_be_positive(argv, value, capsys):
    with pytest.raises(SystemExit) as info:
        main([*argv, value])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert f"argument {argv[-1]}: " in err and "positive whole number" in err and value in err


WRONG_SET = [
    (["pretrain", "--config", f"{CONFIGS}/tiny.toml"], "train.batch_size=abc", "train.batch_size must be an integer"),
    (["sft", "--config", f"{CONFIGS}/sft-tiny.toml"], "sft.generate=abc", "sft.generate must be an integer"),
    (["rl", "--config", f"{CONFIGS}/rl-tiny.toml"], "model.hidden_size=1.5", "model.hidden_size must be an integer"),
    (["synth", "run", "--config", f"{CONFIGS}/synth-tiny.toml", "--out", "OUT"], "simulate.faults.timeout=abc",
     "simulate.faults.timeout must be a number"),
    (["synth", "tools", "--config", f"{CONFIGS}/synth-tiny.toml", "--out", "OUT/t.jsonl"], "tools.categories=5",
     "tools.categories must be a list of strings"),
    (["pipeline", "--config", f"{CONFIGS}/pipeline-tiny.toml"], "threads=abc", "threads must be an integer"),
]


@pytest.mark.parametrize(("argv", "override", "message"), WRONG_SET, ids=[a[0] + "-" + a[1] for a, _, _ in WRONG_SET])
def test_wrong_type_in_set_is_one_line(argv, override, message, tmp_path, capsys):
    argv = [str(tmp_path) if a == "OUT" else a.replace("OUT", str(tmp_path)) for a in argv]
    assert main([*argv, "--set", override]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    value = override.split("=", 1)[1]
    assert message in err and f"--set {override}" in err and value in err


@pytest.mark.parametrize(("command", "base", "table", "line", "message"), [
    ("pretrain", "tiny.toml", "train", 'batch_size = "abc"', "train.batch_size must be an integer, got 'abc'"),
    ("sft", "sft-tiny.toml", "train", "batch_size = true", "train.batch_size must be an integer, got True"),
    ("rl", "rl-tiny.toml", "train", 'iterations = "x"', "train.iterations must be an integer, got 'x'"),
    ("synth", "synth-tiny.toml", "run", 'seed = "s"', "run.seed must be an integer, got 's'"),
    ("pipeline", "pipeline-tiny.toml", "tokenizer", 'vocab_size = "v"', "tokenizer.vocab_size must be an integer"),
])
def test_wrong_type_in_a_toml_file_is_one_line(command, base, table, line, message, tmp_path, capsys):
    import shutil
    from pathlib import Path

    for f in Path(CONFIGS).glob("*.toml"):  # stage files of the pipeline are found next to its file
        shutil.copy(f, tmp_path / f.name)
    bad = tmp_path / "bad.toml"
    bad.write_text(f'base = "{base}"\n[{table}]\n{line}\n')
    argv = [command, "--config", str(bad)]
    if command == "synth":
        argv = ["synth", "run", "--config", str(bad), "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(bad) in err and message in err, err
