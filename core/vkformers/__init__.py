"""vkformers: train and run Hugging Face Transformer models on any GPU through Vulkan."""
# The public subpackages are attributes after `import vkformers`, as torch.optim is after `import torch`.
from vkformers import engine, errors, models, optim, runtime, training  # noqa: F401  (models: plugin kernel dirs)
from vkformers.engine import functional  # noqa: F401
from vkformers.engine.function import no_grad
from vkformers.engine.tensor import Tensor, full, ones, parameter, tensor, zeros
from vkformers.errors import VkformersError
from vkformers.models import generation, loading, tokenizer  # noqa: F401
from vkformers.models.loading import (AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM,
                                       AutoModelForMultipleChoice, AutoModelForQuestionAnswering, AutoModelForSeq2SeqLM,
                                       AutoModelForSequenceClassification, AutoModelForTokenClassification,
                                       AutoTokenizer)
from vkformers.models.cross_encoder import CrossEncoder
from vkformers.models.encoder_decoder import EncoderDecoderModel
from vkformers.models.fill_in_middle import fill_in_middle_prompt, fill_in_middle_tokens
from vkformers.models.sentence import SentenceTransformer
from vkformers.models.pipelines import pipeline
from vkformers.models.quantize import BitsAndBytesConfig
from vkformers.models.streamers import TextIteratorStreamer, TextStreamer
from vkformers.runtime import Buffer, Device, Sequence, dtypes, get_device
from vkformers.runtime.dtypes import bfloat16, bool_, float16, float32, int32, uint8

__version__ = "0.1.0"

__all__ = ["AutoModel", "AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForMultipleChoice",
           "AutoModelForQuestionAnswering",
           "AutoModelForSeq2SeqLM", "AutoModelForSequenceClassification", "AutoModelForTokenClassification",
           "AutoTokenizer", "BitsAndBytesConfig", "Buffer", "CrossEncoder",
           "Device", "EncoderDecoderModel", "SentenceTransformer", "Sequence", "Tensor", "TextIteratorStreamer",
           "TextStreamer", "VkformersError", "bfloat16", "bool_", "dtypes", "engine", "errors",
           "fill_in_middle_prompt", "fill_in_middle_tokens", "float16", "float32", "full",
           "get_device", "int32", "models", "no_grad", "ones", "optim", "parameter",
           "pipeline",
           "runtime", "tensor", "training", "uint8", "zeros"]
