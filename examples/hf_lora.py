"""``examples/hf_trainer.py`` with a LoRA adapter (PEFT): only the adapter and its optimizer
state are checkpointed, the frozen base never is.

    python examples/hf_lora.py [ROOT]     # default: runs/hf-lora
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_trainer import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join("runs", "hf-lora"), lora=True)
