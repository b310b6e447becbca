"""The preflight planner: memory and feasibility from the composed config, before anything is allocated."""
