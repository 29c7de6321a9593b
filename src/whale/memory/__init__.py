"""The memory side of training: measured memory per rank (:mod:`whale.memory.tracker`,
:mod:`whale.memory.monitor`) and activation checkpointing (:mod:`whale.memory.checkpointing`)."""
