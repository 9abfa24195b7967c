"""One module per OpenAI API: its request -> PromptPlan mapping and its reply framer.

protocol.py holds the typed requests and replies, framing.py what every framer shares.
render dispatches a submission through its API's module (stages/render.py `APIS`); emit
gets each request's framer from `framer_for` (stages/emit.py).
"""
