"""Peers: the nodes of a job stage one dataset together, each file read from the source by one node.

:mod:`.world` forms the nodes' own torch.distributed group (gloo over TCP) from torchrun's or srun's
environment and derives the job's key; :mod:`.plan` assigns each file to one reader (pure);
:mod:`.wire` frames and authenticates what goes over the group; :mod:`.exchange` moves the files and
checks every byte on arrival; :mod:`.stage` sequences a stage with peers on top of the stager's steps.
"""
