"""Choosing one option per layer (layer 4): the allocators (:mod:`.allocate`:
greedy, DADO, exact) and writing a plan's compressed checkpoint
(:mod:`.apply`)."""
