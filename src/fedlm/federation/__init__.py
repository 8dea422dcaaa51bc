"""The federated core, independent of any deployment engine and of split learning.

``engine`` is the one round loop (sample -> local work -> encode -> aggregate -> evaluate -> record);
``strategies/`` are the server algorithms it is typed against (FedAvg, FedProx, FedOpt); ``codecs`` encode
and count every byte that crosses; ``params`` holds named-tensor helpers; ``sharing`` decides per parameter
global / local / frozen; ``local_training`` trains one client's model; ``client_round`` is a client's side of
a round (shared by the simulator and Flower); ``store`` keeps clients' local parameters between rounds;
``simulation`` runs the sampled clients in this process.
"""
