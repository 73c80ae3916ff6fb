"""Shared test fixtures: the toy tokenizer, a tiny random Llama, and a scripted fake model; for
the chat format, a Qwen-style byte-level BPE with a Hermes-style chat template and a tiny Qwen2;
the tolerances of float comparisons, and `needs` for a test that needs an optional package."""
import importlib
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import world
from chat.toytokenizer import CHAT_CORPUS, CHAT_SPECIALS, CHAT_TEMPLATE, chat_tokenizer  # (tests import these from here)
from machinery.checkpoint import build_tokenizer
from machinery.config import DEFAULTS


def needs(package):
    """The optional package `package` (a module name, e.g. "bfcl_eval"), imported, for a test or
    fixture that cannot run without it. Missing, the test is skipped, except under CI (the env
    var CI set), where it fails: CI installs every optional package (.ci/run), so a missing one
    there is a broken install, never a pass. Tests that need no optional package never call it."""
    try:
        return importlib.import_module(package)
    except ImportError as e:
        if os.environ.get("CI"):
            pytest.fail(f"{package} is not installed ({e}) and CI is set: CI installs it (.ci/run)", pytrace=False)
        pytest.skip(f"{package} is not installed (CI unset: skipped; under CI this fails)")


def skip_left_out(left_out):
    """Skip a test that ran what it could and left out `left_out` (lines naming what and why): the
    commands an optional package is missing for, outside CI (`needs` and `needs_gguf` fail under CI
    before anything is left out)."""
    pytest.skip(f"{len(left_out)} command(s) not run, the rest ran: " + "; ".join(left_out))


def needs_gguf(spec):
    """The path of a GGUF file inside an optional package ('PACKAGE/FILE.gguf', realmodel.gguf_file:
    found without importing the package), skipped or failed under CI as `needs` does."""
    from machinery.realmodel import ModelFileError, gguf_file
    try:
        return gguf_file(spec)
    except ModelFileError as e:
        if os.environ.get("CI"):
            pytest.fail(f"{e} and CI is set: CI installs it (.ci/run)", pytrace=False)
        pytest.skip(f"{e} (CI unset: skipped; under CI this fails)")


def toy_tokenizer():
    return build_tokenizer(world.WORDS)


# Random weights at 10x transformers' default init (0.02): attention scores of order 1, so a
# token's rotary position matters (a gap of one position after the prompt moves a 2-layer Llama's
# logits by ~1, against LOGPROB_TOLERANCE 1e-5); at 0.02 attention is near uniform and the same gap
# moves them by ~2e-4, which a sampled logprob near 0 (a Bigram bonus) shrinks below 1e-5.
POSITION_INIT = 0.2


def tiny_llama(tokenizer, seed=0, layers=2, width=32, init_range=0.02):
    """A random Llama (RoPE) for the toy tokenizer; init_range=POSITION_INIT where positions matter."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True, initializer_range=init_range)
    return LlamaForCausalLM(config).eval()


class ScriptedModel(torch.nn.Module):
    """A fake causal LM for the sampler: for the row whose task prompt is P it puts all
    probability on scripts[P][k] at the k-th generated position (k = 0 right after the prefix),
    whatever it is fed. Scripts are whitespace-separated tokens and include the forced tags,
    which the sampler must insert itself (the script's choice there is ignored). Which prompt a
    batch row holds is written into the real KV cache, so it follows the sampler's prefix
    sharing and its dropping of finished rows exactly as real keys and values would."""

    def __init__(self, tokenizer, scripts):
        super().__init__()
        self.config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=8, num_hidden_layers=1,
                                  num_attention_heads=1, num_key_value_heads=1)
        self.anchor = torch.nn.Parameter(torch.zeros(1))   # gives the sampler a device
        self.tokenizer = tokenizer
        self.prompts = list(scripts)
        self.scripts = [tokenizer.convert_tokens_to_ids(s.split()) for s in scripts.values()]
        self.vocab = len(tokenizer)

    def _prompt_index(self, ids):
        words = self.tokenizer.convert_ids_to_tokens(ids)
        words = [w for w in words if w not in ("<pad>", "<bos>")]
        end = words.index("<act>") if "<act>" in words else len(words)
        return self.prompts.index(" ".join(words[:end]))

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None):
        B, T = input_ids.shape
        if cache is None:                           # a teacher-forced pass: it knows no script there
            return SimpleNamespace(logits=torch.zeros(B, T, self.vocab))
        who, k = scripted_rows(input_ids, attention_mask, cache, lambda b: self._prompt_index(input_ids[b].tolist()))
        logits = torch.full((B, T, self.vocab), -1e4)
        for b, i in enumerate(who):
            script = self.scripts[i]
            logits[b, -1, script[min(k[b], len(script) - 1)]] = 0.0
        return SimpleNamespace(logits=logits)


def scripted_rows(input_ids, attention_mask, cache, identify):
    """For the fake LMs: (which script each batch row follows, how many ids it was fed after its
    prefill), both kept in the real KV cache (keys: the identity, values: the count), so that they
    follow the sampler's prefix copies, its dropping of rows and the cache a separate round keeps.
    A step feeds each row a run of ids (its holes masked): the count grows by the run's length.
    identify(b): the script of batch row b at its prefill."""
    B, T = input_ids.shape
    if cache.get_seq_length() == 0:                 # prefill
        who, count = torch.tensor([float(identify(b)) for b in range(B)]), torch.zeros(B)
    else:
        who = cache.layers[0].keys[:, 0, -1, 0]
        count = cache.layers[0].values[:, 0, -1, 0] + attention_mask[:, -T:].sum(1).float()
    cache.update(who[:, None, None, None].expand(B, 1, T, 1).contiguous(),
                 count[:, None, None, None].expand(B, 1, T, 1).contiguous(), 0)
    return who.long().tolist(), count.long().tolist()


# Two float32 computations of one gradient that sum in another order (micro-batches or one batch,
# 2 ranks or 1, gradient checkpointing or not, another CPU's kernels or thread count) differ in
# each entry by at most about n * u * (sum of |terms|), u = 2^-24 = 6e-8, for n terms. An entry
# here sums at most a few hundred tokens' products over a 32-64 wide model, and the sum of |terms|
# is within a small factor of the largest entry of its tensor, so 1e-4 of that largest entry holds
# with room; the errors these comparisons are for (a token count off by a rank's share, a loss
# not scaled by world_size, a row left out) move entries by several percent of it.
GRAD_TOLERANCE = 1e-4


# A logprob is a logit minus a logsumexp, |value| < 10 here (V <= 1000, logits of size ~1): float32
# holds it to 1e-6, and its logits, sums over a 32-64 wide hidden state, differ by reduction order
# (a one-token cached decode against a full forward, a sliced LM head) by a few units of that.
# 1e-5 holds with room; a position or a cache row out of place moves logprobs by far more (the
# position tests show it on their own model: helpers.assert_sampled_logprobs_match_a_forward).
LOGPROB_TOLERANCE = 1e-5


def assert_same_gradients(a, b, rel=GRAD_TOLERANCE):
    """a, b: {name: gradient} of the same parameters: each tensor agrees to `rel` x its largest
    entry (GRAD_TOLERANCE says why); returns the largest such ratio seen, for a test's message."""
    assert set(a) == set(b)
    worst = 0.0
    for name, x in a.items():
        scale = x.abs().max().item()
        err = (x - b[name]).abs().max().item()
        assert err <= rel * scale, f"{name}: max difference {err:.3g}, {err / max(scale, 1e-30):.3g} of its largest entry"
        worst = max(worst, err / max(scale, 1e-30))
    print(f"gradients agree to {worst:.2g} of each tensor's largest entry (tolerance {rel:g})")
    return worst


def recording(optimizer_class):
    """optimizer_class whose step first keeps every parameter's gradient (`grads`: {parameter:
    gradient} of the last step; an FSDP gradient made whole, a collective every rank calls alike):
    train.warm_start and rl_step free the gradients once the update is applied, so a test reads
    the step's gradient here (`step_grads`)."""
    class Recording(optimizer_class):
        def step(self, closure=None):
            self.grads = {p: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                          for group in self.param_groups for p in group["params"]}
            return super().step(closure)
    return Recording


def step_grads(model, opt):
    """{name: gradient} of the last step of a `recording` optimizer over model's parameters."""
    return {name: opt.grads[p] for name, p in model.named_parameters()}


def assert_ratio_one(lines, kl_coef=0.0, kl_rehearse_coef=0.0):
    """metrics.jsonl lines of a run with one PPO epoch, whose old logprobs are the sampler's (or
    recomputed from the same weights): every updated step is at ratio 1, so approx_kl (the mean
    of old - new over the trained targets) is 0 within LOGPROB_TOLERANCE, and the loss is minus
    the sum of the trained targets' advantages over their count n, plus each role's KL term
    (kl coefficient x its mean k3 KL x its share of n). With role coefficients 1, the trained
    targets are every ACT and REHEARSE target. At least one step must be updated; returns them."""
    updated = [line for line in lines if line["status"] == "updated"]
    assert updated, [line["status"] for line in lines]
    for line in updated:
        n_act, n_rehearse = line["tokens_act"], line["tokens_rehearse"]
        n = n_act + n_rehearse
        kl = (kl_coef * line.get("kl_ref_act", 0.0) * n_act + kl_rehearse_coef * line.get("kl_ref_rehearse", 0.0)
              * n_rehearse) / n
        assert abs(line["approx_kl"]) < LOGPROB_TOLERANCE, line
        # exp(new - old) within 1e-5 of 1 on every token: the loss within 1e-5 x mean |A| (<= 1) of it
        assert line["loss"] == pytest.approx(-(line["adv_act"] * n_act + line["adv_rehearse"] * n_rehearse) / n + kl,
                                             abs=1e-4), line
    return updated


def fork_process(target, args, log_dir, name="child", env=None):
    """Start `target(*args)` in a forked process, as `python SCRIPT` would run it but with torch,
    transformers and this repo already imported (a new process imports them anew: ~10 s of CPU on
    2 cores): its own pid, signal handlers (Python's defaults), exit status (target's return value;
    1 for an exception, whose traceback goes to stderr) and one thread. Its stdout and stderr go
    to log_dir/NAME.out and NAME.err; `env` is added to its environment; SIGABRT (or a crash)
    writes its stacks there (faulthandler), even from inside a blocked collective. Returns the pid."""
    import faulthandler
    import signal
    import sys
    import traceback
    pid = os.fork()
    if pid:
        return pid
    rc = 1                                      # the child: never returns into pytest
    try:
        for fd, ext in ((1, "out"), (2, "err")):
            f = os.open(os.path.join(log_dir, f"{name}.{ext}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(f, fd)
            os.close(f)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        faulthandler.enable(file=sys.stderr, all_threads=True)
        os.environ.update(env or {})
        torch.set_num_threads(1)
        rc = target(*args)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc if isinstance(rc, int) else 1)


def wait_process(pid, timeout):
    """The exit status of process `pid` (os.waitstatus_to_exitcode: -N for signal N), or None if
    it was still running after `timeout` seconds (then killed, its stacks first written to its
    stderr: fork_process)."""
    import signal
    import time
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    os.kill(pid, signal.SIGABRT)
    time.sleep(1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def read_log(log_dir, name):
    """(stdout, stderr) a fork_process child wrote."""
    return tuple(open(os.path.join(log_dir, f"{name}.{ext}")).read() for ext in ("out", "err"))


def fork_ranks(target, args, log_dir, world_size=2, timeout=120):
    """Run `target(*args)` as `world_size` ranks of one gloo job, as torchrun would: processes
    forked by fork_process with the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT); one test (test_distributed.py) still launches torchrun itself. Each
    rank's output goes to log_dir/rank<N>.out and .err; returns (each rank's exit status, both
    ranks' stderr lines). A rank still running after `timeout` seconds (waiting at a collective)
    fails the test (wait_ranks)."""
    import socket
    with socket.socket() as s:                  # a free port for the rendezvous (torchrun --standalone)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = [fork_process(target, args, log_dir, f"rank{rank}",
                         {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                          "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            for rank in range(world_size)]
    rcs = wait_ranks(pids, log_dir, timeout)
    err = "".join(read_log(log_dir, f"rank{rank}")[1] for rank in range(world_size))
    return rcs, err.replace("\r", "\n").splitlines()


def run_ranks(target, args, log_dir, world_size=2, timeout=120):
    """target(rank, *args) in `world_size` processes forked by fork_process (output in
    log_dir/rank<N>.out and .err), as torch.multiprocessing.start_processes(..., join=True) runs
    them, but never hangs: a rank that raises fails the test at once with its traceback (the
    others, which would wait for it at their next collective, killed), and ranks still running
    after `timeout` seconds (a deadlock) are killed and fail it (wait_ranks)."""
    def rank_main(rank):
        target(rank, *args)
        return 0
    pids = [fork_process(rank_main, (rank,), log_dir, f"rank{rank}") for rank in range(world_size)]
    wait_ranks(pids, log_dir, timeout, stop_at_failure=True)


def wait_ranks(pids, log_dir, timeout, stop_at_failure=False):
    """The exit statuses of the fork_process children `pids` (rank N's output in log_dir/rank<N>.*),
    waiting at most `timeout` seconds for all together. Any still running then (a rank at a
    collective that another never reaches: a deadlock) fails the test, every child killed, naming
    the ranks left and the end of each rank's stderr; with `stop_at_failure` so does, at once, a
    rank that exits with another status than 0."""
    import signal
    import time
    deadline = time.monotonic() + timeout
    rcs = [None] * len(pids)
    while None in rcs:
        for rank, pid in enumerate(pids):
            if rcs[rank] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    rcs[rank] = os.waitstatus_to_exitcode(status)
        failed = [rank for rank, rc in enumerate(rcs) if rc not in (None, 0)] if stop_at_failure else []
        running = [rank for rank, rc in enumerate(rcs) if rc is None]
        if failed or (running and time.monotonic() >= deadline):
            for rank in running:
                os.kill(pids[rank], signal.SIGABRT)         # its stacks to its stderr (fork_process)
            time.sleep(1)
            for rank in running:
                os.kill(pids[rank], signal.SIGKILL)
                os.waitpid(pids[rank], 0)
            why = (f"rank {failed[0]} exited with status {rcs[failed[0]]}" if failed else
                   f"still running after {timeout} s: a deadlock (a rank waiting at a collective another never "
                   f"reaches) or a hang")
            pytest.fail(f"{why}; killed rank(s) {running}; exit statuses {rcs}\n"
                        + "\n".join(f"rank {rank} stderr ends:\n{log_tail(log_dir, f'rank{rank}')}"
                                    for rank in range(len(pids))), pytrace=False)
        if None in rcs:
            time.sleep(0.05)
    return rcs


def log_tail(log_dir, name):
    """stderr_tail of a fork_process child's stderr."""
    return stderr_tail(read_log(log_dir, name)[1])


def stderr_tail(text, n=20):
    """The last `n` lines of a process's stderr, progress bars left out; where faulthandler wrote
    the stacks of hung processes (wait_ranks, run_command), the 5 lines before the first stack
    and the innermost frames of every stack."""
    lines = [line for line in text.replace("\r", "\n").splitlines() if line.strip() and "%|" not in line]
    stacks = [i for i, line in enumerate(lines) if line.startswith(("Current thread", "Thread 0x"))]
    if not stacks:
        return "\n".join(lines[-n:])
    return "\n".join(lines[max(0, stacks[0] - 5):stacks[0]] + [line for i in stacks for line in lines[i:i + 6]])


def descendants(pid):
    """The pids of every process started below `pid`, those in sessions of their own too
    (torchrun starts each worker in a new session): read from /proc."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def run_command(args, timeout, env=None, **kw):
    """subprocess.run(args, capture_output=True, text=True, env=env, **kw) that never hangs:
    still running after `timeout` seconds (a deadlock, a hang), it is killed with every process
    it started (torchrun's workers too, which killing torchrun alone leaves running), and the test
    fails with the end of its stderr, where each Python process wrote its stack (faulthandler)."""
    import signal
    import subprocess
    import time
    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}   # SIGABRT: the stack, then exit
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        hung = descendants(proc.pid) + [proc.pid]
        for signum in (signal.SIGABRT, signal.SIGKILL):
            for pid in hung:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:          # (ended in the meantime)
                    pass
            time.sleep(1)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, args))}: still running after {timeout} s (a deadlock or a hang), killed "
                    f"with every process it started; its stderr ends:\n{stderr_tail(err)}", pytrace=False)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def tiny_cfg(tmp_path, **kw):
    return {**DEFAULTS, "out_dir": str(tmp_path / "run"), "n_layer": 2, "n_embd": 32,
            "n_head": 2, "n_logged": 40, "n_new_logged": 2, "n_rl_tasks": 40, "n_test": 16,
            "snippet_repeats": 1, "sft_steps": 5, "sft_batch_size": 8, "rl_steps": 3,
            "tasks_per_step": 4, "group_size": 4, "micro_batch_tokens": 200, "max_tokens": 48,
            "min_fidelity": 0.0, "lr": 1e-3, **kw}
# ----------------------------------------------------------------------------- chat format fixtures


def tiny_qwen(tokenizer, path=None, seed=0, layers=2, width=64, init_range=0.02):
    """A random 2-layer Qwen2 (RoPE) for the chat tokenizer; saved with the tokenizer if `path` is
    given; init_range=POSITION_INIT where positions matter."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True, initializer_range=init_range,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = Qwen2ForCausalLM(config).eval()
    if path is not None:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return model


def assert_sampled_logprobs_match_a_forward(model, episodes, pad_id, temperature=1.0):
    """KV-cached sampling against the simple path: every logprob the sampler recorded for a token
    it sampled (role ACT or REHEARSE, logprob not 0: forced ids, a planned call's too, record 0)
    equals a full teacher-forced forward's over the finished rows (LOGPROB_TOLERANCE), and every
    token of another role records 0. The model must see positions: the same forward with a gap of
    one position after each row's prompt (what an off-by-one in the decoder's positions gives)
    moves some compared logprob by more than 10 x the tolerance, or the comparison could not tell
    a position error (a position-blind model, or near-uniform attention, passes whatever the
    positions). Returns the number of compared tokens."""
    from envace import ACT, REHEARSE, collate, token_logprobs
    ids, _ = collate(episodes, pad_id)
    L = ids.shape[1]
    gap = torch.stack([torch.arange(L) + (torch.arange(L) >= e["prompt_len"]).long() for e in episodes])
    with torch.no_grad():
        full = token_logprobs(model, ids, temperature)
        # (with an attention mask: without one, transformers reads a jump in position_ids as the
        # start of another packed sequence and masks the prompt out, which is no position effect)
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=gap, use_cache=False).logits
        shifted = F.log_softmax(logits[:, :-1].float() / temperature, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    compared, moved = 0, 0.0
    for i, e in enumerate(episodes):
        for t in range(1, len(e["ids"])):
            if e["roles"][t] not in (ACT, REHEARSE):
                assert e["logprobs"][t] == 0.0, (i, t)
            elif e["logprobs"][t] != 0.0:
                assert abs(e["logprobs"][t] - full[i, t - 1].item()) < LOGPROB_TOLERANCE, (i, t)
                moved = max(moved, abs(shifted[i, t - 1].item() - full[i, t - 1].item()))
                compared += 1
    print(f"{compared} sampled logprobs match a full forward; a one-position gap moves them up to {moved:.2g}")
    assert compared > 0 and moved > 10 * LOGPROB_TOLERANCE, (compared, moved)
    return compared


def assert_rehearse_logprobs_match_a_forward(model, rows, pad_id):
    """Sampled rehearse rows: every token after the prompt is a sampled REHEARSE token, and
    assert_sampled_logprobs_match_a_forward holds."""
    from envace import REHEARSE
    for r in rows:
        assert r["cause"] in ("response", "bad_rehearsal", "env_limit")
        assert set(r["roles"][r["prompt_len"]:]) == {REHEARSE}
    assert assert_sampled_logprobs_match_a_forward(model, rows, pad_id) >= len(rows)


class Bigram(torch.nn.Module):
    """A real model (its logits depend on the whole KV-cached context) with a fixed bonus on the
    token that `pairs` ({word: next word}) names after each input word: random weights that still
    write calls and responses, so cached decoding is tested on whole episodes against a full forward."""

    def __init__(self, model, tokenizer, pairs, bonus=8.0):
        super().__init__()
        self.model, self.config = model, model.config
        self.bias = torch.zeros(len(tokenizer), len(tokenizer))
        for a, b in pairs.items():
            self.bias[tokenizer.convert_tokens_to_ids(a), tokenizer.convert_tokens_to_ids(b)] = bonus

    def forward(self, input_ids, **kw):
        out = self.model(input_ids=input_ids, **kw)
        out.logits = out.logits + self.bias[input_ids[:, -out.logits.shape[1]:]]
        return out


def import_graph(root):
    """{module: the repo's modules it imports anywhere in its file}, dotted as Python names them:
    the files at the root ("train") and in its packages ("chat.format"); `from chat import format`
    counts as importing chat.format, `from chat.format import x` too."""
    import ast
    import glob
    import os
    files = {os.path.relpath(f, root)[:-3].replace(os.sep, "."): f
             for f in glob.glob(os.path.join(root, "*.py")) + glob.glob(os.path.join(root, "*", "*.py"))
             if not os.path.relpath(f, root).startswith(("tests", "docs"))
             and not f.endswith("__init__.py")}
    graph = {}
    for m, f in files.items():
        names = set()
        for node in ast.walk(ast.parse(open(f).read())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names |= {f"{node.module}.{a.name}" for a in node.names}
        graph[m] = names & set(files) - {m}
    return graph


def without_seconds(value):
    """An eval.json (or any value) without its wall times, the one part two runs never share."""
    return {k: without_seconds(v) for k, v in value.items() if k != "seconds"} if isinstance(value, dict) else value


def wrap_train_logprobs(wrap, setattr=setattr):
    """Wrap the logprob pass of train.py by `wrap(fn) -> fn` as a run's setup chooses it
    (train.chosen_logprobs: the plain definition or the lean pass), and return the plain definition
    wrapped, for a test that calls train.warm_start or train.rl_step itself (their `logprobs`
    argument). `setattr`: monkeypatch.setattr in a test (undone after it); the builtin in a
    torchrun worker."""
    import envace
    import train
    chosen = train.chosen_logprobs
    setattr(train, "chosen_logprobs", lambda cfg: wrap(chosen(cfg)))
    return wrap(envace.token_logprobs)
