"""A production engine driven through its API: a real vLLM server's speculation as SpecLens events
(``backend``, on ``client``: HTTP to the server, and ``steps``: its stream as steps), starting and stopping
one (``server``), and throughput at batch sizes (``batch``).
"""
