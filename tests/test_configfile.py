"""openk2.configfile: TOML `base =` inheritance, strict typed sections, `--set` overrides, and one-line errors
that name the key, the file (or `--set`) and the valid keys, for every TOML-driven command."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from openk2.agentic.synth_config import SynthConfig, load_synth_config
from openk2.cli import main as cli_main
from openk2.config import ModelConfig
from openk2.configfile import (
    ConfigError,
    apply_overrides,
    build_section,
    check_type,
    config_errors,
    load_config,
    parse_value,
    read_toml,
)
from openk2.pipeline.config import load_pipeline_config
from openk2.pipeline.stages import build_stages
from openk2.rl.config import RLConfig, load_rl_config
from openk2.train.config import RunConfig, SFTSection, load_run_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@dataclasses.dataclass(kw_only=True)
class Demo:
    steps: int = 3
    lr: float = 0.1
    name: str | None = None
    flags: list[int] = dataclasses.field(default_factory=list)
    on: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"demo.steps must be >= 1, got {self.steps}")


def test_read_toml_inherits_and_merges(tmp_path):
    (tmp_path / "base.toml").write_text('a = 1\n[t]\nx = 1\ny = 2\n')
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "child.toml").write_text('base = "../base.toml"\n[t]\ny = 3\n')
    assert read_toml(tmp_path / "sub" / "child.toml") == {"a": 1, "t": {"x": 1, "y": 3}}
    assert read_toml(tmp_path / "sub" / "child.toml", inherit=False) == {"base": "../base.toml", "t": {"y": 3}}
    (tmp_path / "orphan.toml").write_text('base = "gone.toml"\n')
    with pytest.raises(ConfigError, match=r"orphan.toml: base file .*gone.toml not found"):
        read_toml(tmp_path / "orphan.toml")
    (tmp_path / "bad.toml").write_text("x = = 1\n")
    with pytest.raises(ConfigError, match="bad.toml is not valid TOML"):
        read_toml(tmp_path / "bad.toml")


def test_overrides_parse_as_toml_else_strings():
    assert [parse_value(v) for v in ("3", "1e-3", "true", '"fp32"', "fp32", "[1, 2]", "hf:smollm2")] == \
        [3, 1e-3, True, "fp32", "fp32", [1, 2], "hf:smollm2"]
    assert apply_overrides({"a": {"b": 1}}, ["a.c=2", "d.e.f=x"]) == {"a": {"b": 1, "c": 2}, "d": {"e": {"f": "x"}}}
    for bad, message in (("a.b", "expected SECTION.KEY=VALUE"), ("a..b=1", "empty"), ("a.b.c=1", "a.b is a value")):
        with pytest.raises(ConfigError, match=message):
            apply_overrides({"a": {"b": 1}}, [bad])


def test_sections_are_strict_and_typed():
    assert build_section(Demo, "demo", {"steps": 5, "lr": 1, "flags": [1, 2]}) == Demo(steps=5, lr=1, flags=[1, 2])
    cases = [({"stepz": 1}, r"unknown key\(s\) in \[demo\]: stepz \(valid keys: flags, lr, name, on, steps\)"),
             ({"steps": "abc"}, "demo.steps must be an integer, got 'abc'"),
             ({"steps": 2.5}, "demo.steps must be an integer"),
             ({"steps": True}, "demo.steps must be an integer"),
             ({"lr": "x"}, "demo.lr must be a number"),
             ({"on": 1}, "demo.on must be true or false"),
             ({"name": 3}, r"demo.name must be a string \(or left out\)"),
             ({"flags": [1, "x"]}, r"demo.flags\[1\] must be an integer"),
             ({"flags": 3}, "demo.flags must be a list of integers"),
             ({"steps": 0}, "demo.steps must be >= 1")]
    for values, message in cases:
        with pytest.raises(ConfigError, match=message) as info:
            build_section(Demo, "demo", values)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"\[demo\] must be a table"):
        build_section(Demo, "demo", 3)
    check_type(None, str | None, "x")


def test_errors_name_the_file_the_base_file_or_the_set(tmp_path):
    (tmp_path / "base.toml").write_text("[demo]\nsteps = 2\nlr = 'fast'\n")
    (tmp_path / "child.toml").write_text('base = "base.toml"\n[demo]\nsteps = "two"\n')
    child = tmp_path / "child.toml"

    def build(raw):
        return build_section(Demo, "demo", raw.get("demo", {}))

    with pytest.raises(ValueError, match=rf"^{child}: demo.steps must be an integer, got 'two'$"):
        load_config(child, [], build)
    with pytest.raises(ValueError, match=r"base.toml \(inherited by .*child.toml\): demo.lr must be a number"):
        load_config(child, ["demo.steps=2"], build)
    with pytest.raises(ValueError, match=rf"^{child} --set demo.stepz=1: unknown key\(s\) in \[demo\]: stepz"):
        load_config(child, ["demo.stepz=1", "demo.lr=0.5"], build)
    # a value the dataclass rejects concerns its whole table: every --set into it is named
    with pytest.raises(ValueError, match=rf"^{child} --set demo.steps=0 --set demo.lr=0.5: demo.steps must be >= 1"):
        load_config(child, ["demo.steps=0", "demo.lr=0.5"], build)
    with pytest.raises(ValueError, match=rf"^{child} --set demo.steps: expected SECTION.KEY=VALUE$"):
        load_config(child, ["demo.steps"], build)
    with pytest.raises(ValueError, match=r"^--set demo.on=yes: demo.on must be true or false, got 'yes'$"):
        load_config(None, ["demo.on=yes"], build)
    with pytest.raises(ValueError, match=r"^f.toml in the \[x\] layer: demo.steps must be an integer"):
        with config_errors("f.toml", layers=[("the [x] layer", {"demo": {"steps": "s"}})]):
            build({"demo": {"steps": "s"}})


# ------------------------------------------------------------------------------------ every TOML command
COMMANDS = {  # command -> (shipped config, loader, a valid key of an int-typed field)
    "pretrain": (CONFIGS / "tiny.toml", load_run_config, "train.steps"),
    "sft": (CONFIGS / "sft-tiny.toml", load_run_config, "train.steps"),
    "rl": (CONFIGS / "rl-tiny.toml", load_rl_config, "train.iterations"),
    "synth": (CONFIGS / "synth-tiny.toml", load_synth_config, "run.concurrency"),
    "pipeline": (CONFIGS / "pipeline-tiny.toml", load_pipeline_config, "eval.limit"),
}


def _cli_argv(command: str, config: Path, overrides: list[str], tmp_path: Path) -> list[str]:
    sets = [arg for item in overrides for arg in ("--set", item)]
    if command == "synth":
        return ["synth", "run", "--config", str(config), "--out", str(tmp_path / "synth"), *sets]
    return [command, "--config", str(config), *sets]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_bad_input_is_one_line_naming_key_file_and_valid_keys(command, tmp_path, capsys):
    config, load, int_key = COMMANDS[command]
    section, key = int_key.split(".")
    cases = [  # override, regex of the message
        (f"{section}.{key}z=1", rf"^{config} --set {section}.{key}z=1: unknown key\(s\) in \[{section}\]: {key}z "
                                rf"\(valid keys: .*\b{key}\b.*\)$"),
        (f"{int_key}=abc", rf"^{config} --set {int_key}=abc: {int_key} must be an integer, got 'abc'$"),
        (f"{int_key}='7'", rf"^{config} --set {int_key}='7': {int_key} must be an integer, got '7'$"),
        (f"{int_key}", rf"^{config} --set {int_key}: expected SECTION.KEY=VALUE$"),
        ("nosuch.key=1", rf"^{config} --set nosuch.key=1: unknown (section|pipeline key)\(s\).*: nosuch "
                         r"\(valid keys: .*\)$"),
    ]
    for override, message in cases:
        with pytest.raises(ValueError, match=message):
            load(config, [override])
        assert cli_main(_cli_argv(command, config, [override], tmp_path)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"openk2 {command}: error: {config} --set "), (override, err)

    # the same mistakes written in a config file (inheriting the shipped one)
    stages = "".join(f'[{stage}]\nconfig = "{CONFIGS / name}"\n' for stage, name in
                     (("pretrain", "tiny.toml"), ("sft", "sft-tiny.toml"), ("rl", "rl-tiny.toml")))
    base = f'base = "{config}"\n' + (stages if command == "pipeline" else "")  # stage files: relative to the child
    (tmp_path / "typo.toml").write_text(f'{base}[{section}]\n{key}z = 1\n')
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'typo.toml'}: unknown key\(s\) in \[{section}\]: {key}z "
                                         rf"\(valid keys: .*\)$"):
        load(tmp_path / "typo.toml")
    (tmp_path / "type.toml").write_text(f'{base}[{section}]\n{key} = "many"\n')
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'type.toml'}: {int_key} must be an integer, got 'many'$"):
        load(tmp_path / "type.toml")
    assert cli_main(_cli_argv(command, tmp_path / "type.toml", [], tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"openk2 {command}: error: {tmp_path / 'type.toml'}: {int_key}")


def test_pipeline_stage_errors_name_the_stage_file_or_its_set_table(tmp_path):
    cfg = load_pipeline_config(CONFIGS / "pipeline-tiny.toml", ["pretrain.set.train.steps=abc"])
    with pytest.raises(ValueError, match=r"tiny.toml in the pipeline's \[pretrain.set\]: train.steps must be an "
                                         r"integer, got 'abc'$"):
        build_stages(cfg, tmp_path / "run")
    cfg = load_pipeline_config(CONFIGS / "pipeline-tiny.toml", ["rl.set.rollout.temprature=1.0"])
    with pytest.raises(ValueError, match=r"rl-tiny.toml in the pipeline's \[rl.set\]: unknown key\(s\) in \[rollout\]"):
        build_stages(cfg, tmp_path / "run")


def test_nested_tables_are_checked_too():
    with pytest.raises(ValueError, match=r"unknown key\(s\) in \[data.sources\[0\]\]: wieght \(valid keys: .*kind"):
        load_run_config(None, ['data.sources=[{kind = "math", wieght = 1}]'])
    with pytest.raises(ValueError, match=r"data.sources\[0\].num_docs must be an integer"):
        load_run_config(None, ['data.sources=[{kind = "math", num_docs = "many"}]'])
    with pytest.raises(ValueError, match=r"simulate.faults.timeout must be a number, got 'often'"):
        SynthConfig.from_dict({"simulate": {"faults": {"timeout": "often"}}})
    with pytest.raises(ValueError, match=r"model.hidden_size must be an integer"):
        RLConfig.from_dict({"model": {"hidden_size": "wide"}})


def test_sft_section_is_typed_on_the_run_config():
    cfg = load_run_config(CONFIGS / "sft-tiny.toml")
    assert isinstance(cfg.sft, SFTSection) and RunConfig.from_dict(cfg.to_dict()) == cfg
    assert load_run_config(CONFIGS / "tiny.toml").sft is None


def test_configs_round_trip_through_to_dict(tmp_path):
    for cfg in (load_run_config(CONFIGS / "tiny.toml"), load_run_config(CONFIGS / "small.toml")):
        assert RunConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    rl = load_rl_config(CONFIGS / "rl-tiny.toml", ["task.difficulties=[2, 3]", "loss.name='grpo'"])
    assert RLConfig.from_dict(json.loads(json.dumps(rl.to_dict()))) == rl
    policy = tmp_path / "policy"  # a policy started from a checkpoint keeps `[model] checkpoint`
    policy.mkdir()
    (policy / "config.json").write_text(json.dumps(ModelConfig.preset("tiny").to_hf()))
    rl = RLConfig.from_dict({"model": {"checkpoint": str(policy)}, "train": {"iterations": 3}})
    assert rl.checkpoint == str(policy)
    assert RLConfig.from_dict(json.loads(json.dumps(rl.to_dict()))) == rl
    synth = load_synth_config(CONFIGS / "synth-tiny.toml")
    assert SynthConfig.from_dict(synth.to_dict()) == synth


def test_foundation_modules_import_nothing_else_from_openk2():
    code = ("import sys, openk2.configfile, openk2.rng; "
            "print(sorted(m for m in sys.modules if m.startswith('openk2')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(["openk2", "openk2.configfile", "openk2.rng"])
