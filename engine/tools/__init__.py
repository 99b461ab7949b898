"""What the CLI and the app run on top of the engine: measurements (the bench, races, pass costs), checks (greedy
parity, exactness, selfcheck), the analyzer of a server's traffic, memory plans and launch commands.
"""
