"""Speculative decoding: a cheap drafter proposes ``k`` tokens, the target verifies them in one forward pass.

One engine step of a speculating request (:class:`~kvpage.engine.engine.LLMEngine`)::

    schedule   its last sampled token + k lookahead slots (the scheduler; dropped before preempting anyone)
    propose    the drafter writes its KV into those slots and returns d <= k drafts   (proposer, model_drafter)
    verify     the target runs [last, d1..dd] in one pass; acceptance keeps a prefix  (acceptance)
    rollback   num_computed moves past the kept tokens; the rejected drafts' slots and blocks go back
    index      only full, verified blocks enter the prefix index (a draft model's KV bounds it, case C19)

Methods (:mod:`.config`): ``ngram`` (prompt lookup, :mod:`.ngram`), ``draft_model`` (a separate model in the
spec's ``draft`` layer group) and ``layer_skip`` (the target's early exit as its own draft). Counters as vLLM
names them are in :mod:`.metrics`.
"""
