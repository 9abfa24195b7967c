"""The eight stages, one module each: render, admit, schedule (a package: the scheduler, its
blocks and drafter), gpu_step, detokenize, parse, account, emit. Beside them: messages.py
(what flows between stages), api/ (each API's protocol: requests, plans, framers, tool
parsers, Harmony) and lib/ (small helpers the stages share: replies, deltas, histograms)."""
