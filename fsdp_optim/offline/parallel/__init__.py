"""Offline verbs run by many processes under ``torchrun`` (or any process group): the work split by bytes
(:mod:`fsdp_optim.core.split`), each process writing its share into one staging directory, one commit by process 0
once every share is written and verified (:mod:`.reshard`); a verb with no split of its own runs on process 0 while
the others wait for its outcome (:func:`.shared.alone`)."""
