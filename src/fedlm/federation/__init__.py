"""The federated core, independent of any deployment engine and of split learning.

``engine`` is the one round loop (sample -> local work -> fold each report into the aggregate -> evaluate ->
record) and ``round_settings``, the one place a round's client settings are made; ``executor`` is where clients
run (the jobs, the reports, the ``Executor`` base with its round hooks); ``observer`` is what a round tells whoever
watches it; ``records`` are the typed round records (``metrics.jsonl``'s lines); ``strategies/`` are the server
algorithms (``Strategy``: configure the clients, aggregate their updates one at a time, keep a ledger); ``privacy``
wraps them in client-level or sample-level DP (``opacus``: the optional Opacus, its accountants; ``dp_sgd``: the
clients' DP-SGD); ``codecs`` encode and count every byte that crosses; ``params`` holds named-tensor helpers;
``sharing`` decides per parameter global / local / frozen; ``local_training`` trains one client's model;
``client_round`` is a client's side of a round (shared by the simulator and Flower); ``store`` keeps clients'
local parameters between rounds; ``simulation`` runs the sampled clients in this process.
"""
