"""Multi-hop tabular reasoning and cross-table aggregation over two small markdown tables.

`employees(name, department, salary, age)` and `departments(department, city, manager)`; every manager is an
employee. Questions by difficulty:

1. city of an employee's department (two hops across the tables)
2. salary of the manager of an employee's department (three hops)
3. total salary of the employees working in a city (join, then sum)
4. number of employees older than an age in a city (join, filter, count)
5. the city with the highest total salary (join, group, sum, argmax)

`data` holds the tables, the query and the answer. Numbers are compared as integers, names ignoring case.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

from openk2.rl.tasks.arithmetic import parse_int
from openk2.rl.tasks.base import Problem, Task, extract_answer

_NAMES = ("Alice Bruno Chen Dara Emil Fatima Goran Hana Ivan Jana Kofi Lena Mateo Nina Omar Priya Quinn Rosa "
          "Sven Tara Umar Vera Wang Xenia Yusuf Zoe").split()
_CITIES = ("Lisbon Oslo Kyoto Lima Accra Perth Quito Turin").split()
_DEPARTMENTS = ("Sales Research Legal Finance Design Support Logistics").split()
_LEVELS = {1: (6, 3), 2: (8, 3), 3: (10, 4), 4: (14, 5), 5: (18, 6)}  # employees, departments
_QUERY = {1: "city_of", 2: "manager_salary", 3: "city_total_salary", 4: "city_count_older", 5: "top_city"}


class TablesTask(Task):
    name = "tables"
    num_difficulties = len(_LEVELS)
    max_tokens = 2048

    def generate(self, seed: int, difficulty: int = 1) -> Problem:
        difficulty = self._check_difficulty(difficulty)
        rng = random.Random(f"{self.name}:{seed}:{difficulty}")
        while True:
            tables = _random_tables(rng, *_LEVELS[difficulty])
            query = _random_query(rng, tables, _QUERY[difficulty])
            totals = sorted(_city_totals(tables).values())
            if query["kind"] != "top_city" or len(totals) == 1 or totals[-1] != totals[-2]:
                break  # a tie for the top city would have two right answers
        data = {"tables": tables, "query": query, "answer": answer_query(tables, query)}
        prompt = f"{render_tables(tables)}\n\n{_question(query)}"
        return self._problem(prompt, data, seed, difficulty)

    def verify(self, problem: Problem, response_text: str) -> float:
        answer = extract_answer(response_text)
        if answer is None:
            return 0.0
        expected = problem.data["answer"]
        if isinstance(expected, int):
            return float(parse_int(answer) == expected)
        return float(answer.strip().strip("\"'*.").lower() == str(expected).lower())


def answer_query(tables: dict[str, list[dict]], query: dict[str, Any]) -> int | str:
    """The answer to `query` over `tables` (the reference solver)."""
    employees = {row["name"]: row for row in tables["employees"]}
    departments = {row["department"]: row for row in tables["departments"]}
    city_of = {name: departments[row["department"]]["city"] for name, row in employees.items()}
    kind = query["kind"]
    if kind == "city_of":
        return city_of[query["employee"]]
    if kind == "manager_salary":
        manager = departments[employees[query["employee"]]["department"]]["manager"]
        return employees[manager]["salary"]
    if kind == "city_total_salary":
        return sum(row["salary"] for name, row in employees.items() if city_of[name] == query["city"])
    if kind == "city_count_older":
        return sum(1 for name, row in employees.items() if city_of[name] == query["city"] and row["age"] > query["age"])
    if kind == "top_city":
        totals = _city_totals(tables)
        return max(totals, key=totals.__getitem__)
    raise ValueError(f"unknown table query kind {kind!r}")


def _city_totals(tables: dict[str, list[dict]]) -> dict[str, int]:
    city = {row["department"]: row["city"] for row in tables["departments"]}
    totals: dict[str, int] = defaultdict(int)
    for row in tables["employees"]:
        totals[city[row["department"]]] += row["salary"]
    return dict(totals)


def render_tables(tables: dict[str, list[dict]]) -> str:
    """The tables as markdown, each under its name."""
    parts = []
    for table_name, rows in tables.items():
        columns = list(rows[0])
        lines = [f"Table {table_name}:", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def _random_tables(rng: random.Random, num_employees: int, num_departments: int) -> dict[str, list[dict]]:
    names = rng.sample(_NAMES, num_employees)
    departments = rng.sample(_DEPARTMENTS, num_departments)
    cities = [rng.choice(_CITIES) for _ in departments]
    # Every department gets at least one employee, so every department has a manager from its own staff.
    staff = departments + [rng.choice(departments) for _ in range(num_employees - num_departments)]
    rng.shuffle(staff)
    employees = [{"name": n, "department": d, "salary": rng.randrange(30, 130) * 1000, "age": rng.randint(22, 64)}
                 for n, d in zip(names, staff, strict=True)]
    managers = {d: rng.choice([e["name"] for e in employees if e["department"] == d]) for d in departments}
    rows = [{"department": d, "city": c, "manager": managers[d]} for d, c in zip(departments, cities, strict=True)]
    return {"employees": employees, "departments": rows}


def _random_query(rng: random.Random, tables: dict[str, list[dict]], kind: str) -> dict[str, Any]:
    cities = sorted({row["city"] for row in tables["departments"]})
    if kind in ("city_of", "manager_salary"):
        return {"kind": kind, "employee": rng.choice(tables["employees"])["name"]}
    if kind == "city_total_salary":
        return {"kind": kind, "city": rng.choice(cities)}
    if kind == "city_count_older":
        return {"kind": kind, "city": rng.choice(cities), "age": rng.randint(30, 50)}
    return {"kind": kind}


def _question(query: dict[str, Any]) -> str:
    return {
        "city_of": "In which city does {employee} work?",
        "manager_salary": "What is the salary of the manager of the department {employee} works in?",
        "city_total_salary": "What is the total salary of all employees who work in {city}?",
        "city_count_older": "How many employees who work in {city} are older than {age}?",
        "top_city": "Which city has the highest total salary over the employees who work there?",
    }[query["kind"]].format(**query)
