"""The copy engine: copy a plan's files, hashed while they stream, under temp names, then renamed.

``copier`` (the dispatcher in the stager's process) -> ``workerpool`` (copy worker processes) -> ``copyops``
(one small file or one range) with ``largefiles`` (ranges and their journal), ``incoming`` (the version
being staged: journal, resume), ``feed`` (the files a run is given), ``gate`` (how many workers run).
"""
