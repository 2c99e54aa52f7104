"""Agentic data synthesis for tool use (report section 3.1.1): tools, agents, tasks, simulation, judging, sandbox."""
