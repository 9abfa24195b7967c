"""The message layer sits below the protocol: stages/messages.py (with what it carries,
ToolPlan and ReplySpec) imports no API module, no stage, no trio and no torch, so any
process and any layer can hold its messages."""
import subprocess
import sys
import textwrap

_CHECK = textwrap.dedent("""
    import sys
    import stages.messages
    loaded = sorted(m for m in sys.modules
                    if m.startswith(("stages.api", "trio", "torch", "pipeline", "web"))
                    or m in ("stages.render", "stages.admit", "stages.schedule",
                             "stages.detokenize", "stages.parse", "stages.account",
                             "stages.emit"))
    assert not loaded, loaded
    print("ok")
""")


def test_messages_import_no_api_module_stage_trio_or_torch():
    out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
