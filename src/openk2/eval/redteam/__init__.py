"""Safety red-teaming (report: "Safety Evaluation"): plugins (risk categories with seed goals) x strategies
(how an attack is delivered), an attacker model writing the prompts and a judge model grading the target's
replies. `openk2 redteam` runs the grid; `run_redteam` is the Python API."""

from openk2.eval.redteam.judge import Judgement, judge_response, parse_verdict
from openk2.eval.redteam.plugins import PLUGINS, Goal
from openk2.eval.redteam.runner import run_redteam
from openk2.eval.redteam.strategies import STRATEGIES, AttackSettings, Roles

__all__ = ["PLUGINS", "STRATEGIES", "AttackSettings", "Goal", "Judgement", "Roles", "judge_response",
           "parse_verdict", "run_redteam"]
