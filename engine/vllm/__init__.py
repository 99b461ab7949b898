"""A production engine driven through its API: a real vLLM server's speculation as SpecLens events
(``backend``), starting and stopping one (``server``), and throughput at batch sizes (``batch``).
"""
