"""Tasks of your own under `rollout.placement = "ray"`: a rollout worker rebuilds each tool task from its name alone,
so a task named by import path ("module:Factory") is rebuilt in the worker's own process, while a name only
`register`ed in the driver is refused when the config loads, in one line naming the task and the fix (and, if it
was registered after the config was loaded, the worker says the same instead of failing inside Ray)."""

import os
from pathlib import Path

import pytest

from openk2.rl import tasks
from openk2.rl.config import load_rl_config
from openk2.rl.tasks.arithmetic import ArithmeticTask
from openk2.rl.tasks.lookup import LookupTask
from openk2.rl.tasks.tool_task import ToolTask

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "rl-tiny.toml"
HERE = "tests.rl.test_ray_placement_tasks"


class RenamedLookup(LookupTask):
    """A user's tool task, defined in an importable module (this one)."""


def _config(tmp_path: Path, task: str, placement: str):
    path = tmp_path / "mixture.toml"
    path.write_text(f'base = "{CONFIG.as_posix()}"\n[[envs]]\nname = "mine"\ntask = "{task}"\n')
    return load_rl_config(path, [f"rollout.placement='{placement}'"])


def test_an_import_path_names_a_task_without_registering_it():
    task = tasks.get(f"{HERE}:RenamedLookup")
    assert type(task) is RenamedLookup and isinstance(task, ToolTask)
    assert type(tasks.get("openk2.rl.tasks.arithmetic:ArithmeticTask")) is ArithmeticTask
    for path, error in [("no_such_module_k2:Task", "cannot import module 'no_such_module_k2'"),
                        (":Task", "cannot import module ''"),
                        ("openk2.rl.tasks.lookup:Nope", "has no 'Nope'"),
                        ("openk2.rl.tasks:ANSWER_INSTRUCTION", "is not callable")]:
        with pytest.raises(ValueError, match=error) as err:
            tasks.get(path)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="import path 'module:Factory'"):
        tasks.get("no-such-task")  # the unknown-name error says that import paths are accepted


def test_a_driver_only_tool_task_is_refused_when_a_ray_config_loads(tmp_path, monkeypatch):
    monkeypatch.setitem(tasks._USER, "mine", RenamedLookup)
    with pytest.raises(ValueError) as err:
        _config(tmp_path, "mine", "ray")
    message = str(err.value)
    assert "\n" not in message and "'mine'" in message and 'placement = "ray"' in message, message
    assert f'import path "{HERE}:RenamedLookup"' in message  # the exact fix
    assert _config(tmp_path, "mine", "colocated").environments()[0].task_name == "mine"  # colocated: fine
    assert _config(tmp_path, f"{HERE}:RenamedLookup", "ray").rollout.placement == "ray"  # the fix loads

    class Local(LookupTask):  # defined in a function: no other process can import it
        pass

    monkeypatch.setitem(tasks._USER, "mine", Local)
    with pytest.raises(ValueError, match="move .*Local into a module the workers can import"):
        _config(tmp_path, "mine", "ray")
    monkeypatch.setitem(tasks._USER, "mine", lambda: Local())  # a plain factory: judged by what it builds
    with pytest.raises(ValueError, match="'mine' is registered"):
        _config(tmp_path, "mine", "ray")


def test_single_turn_and_builtin_tasks_pass_the_ray_check(tmp_path, monkeypatch):
    class Echo(ArithmeticTask):  # single-turn: scored in the driver, never rebuilt on a worker
        pass

    monkeypatch.setitem(tasks._USER, "mine", Echo)
    assert _config(tmp_path, "mine", "ray").environments()[0].task_name == "mine"
    assert _config(tmp_path, "lookup", "ray").environments()[0].task_name == "lookup"
    tasks.check_rebuildable("rg:leg_counting")  # reasoning-gym names resolve anywhere: not even built here


# ---------------------------------------------------------------------- a real Ray worker process


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]')")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def _worker_args():
    from openk2.config import ModelConfig
    from openk2.data.tokenizer import train_tokenizer
    from openk2.rl.ray_worker import tokenizer_files
    from openk2.rl.rollout import PartialRollout

    tokenizer = train_tokenizer(["look up the value of key a7 and answer 12"] * 50, 768)
    model = ModelConfig.preset("tiny").replace(vocab_size=768, hidden_size=64, intermediate_size=128,
                                               moe_intermediate_size=32, num_hidden_layers=1, q_lora_rank=32,
                                               n_routed_experts=4)
    return tokenizer, (model, tokenizer_files(tokenizer), PartialRollout(max_tokens=4))


@pytest.mark.slow
def test_a_ray_worker_rebuilds_an_import_path_task_and_names_a_driver_only_one(ray_local, monkeypatch):
    from openk2.rl.ray_placement import _one_line
    from openk2.rl.ray_worker import RolloutWorker
    from openk2.rl.tool_rollout import ToolRollout

    tokenizer, args = _worker_args()

    def spec(task_name: str) -> dict:  # what RayPlacement sends a worker for one tool environment
        return ToolRollout(RenamedLookup(), tokenizer, max_tokens=8, max_turns=2, max_context=256, max_batch_size=2,
                           task_name=task_name).spec()

    actor = ray_local.remote(RolloutWorker).options(num_cpus=1)
    good = actor.remote(*args, tools={"mine": spec(f"{HERE}:RenamedLookup")})
    try:  # the worker imported this module itself: nothing was registered in its process
        assert ray_local.get(good.tool_tasks.remote(), timeout=120) == {"mine": f"{HERE}:RenamedLookup"}
        assert ray_local.get(good.pid.remote()) != os.getpid()
    finally:
        ray_local.kill(good)

    monkeypatch.setitem(tasks._USER, "mine", RenamedLookup)  # registered after the config check: the worker says
    bad = actor.remote(*args, tools={"mine": spec("mine")})
    try:
        with pytest.raises(ray_local.exceptions.RayError) as err:
            ray_local.get(bad.pid.remote(), timeout=120)
        message = _one_line(err.value)  # the line RayPlacement raises as "starting the rollout workers failed: ..."
        assert "\n" not in message and message.startswith("ValueError: rollout worker: cannot rebuild tool "
                                                          "environment 'mine'"), message
        assert "unknown RL task 'mine'" in message and 'name it by import path, task = "module:Factory"' in message
    finally:
        ray_local.kill(bad)
