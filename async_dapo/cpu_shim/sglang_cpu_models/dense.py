"""SGLang's own Qwen2/Qwen3 dense model classes, registered by name (see __init__)."""

from sglang.srt.models.qwen2 import Qwen2ForCausalLM
from sglang.srt.models.qwen3 import Qwen3ForCausalLM

EntryClass = [Qwen2ForCausalLM, Qwen3ForCausalLM]
