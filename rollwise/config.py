"""Typed configuration: one pydantic section per component, loaded from YAML plus
`section.key=value` overrides. Defaults are the embedded CPU run; a bad key, type or value
fails before any work with a message that names the field, the value and what is allowed.

    cfg = load_config("configs/default.yaml", ["train.lr=1e-4", "run.seed=1"])
"""

from __future__ import annotations

import difflib
import re
import textwrap
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from rollwise import presets, registry
from rollwise.errors import ConfigError
from rollwise.preflight import check_paths

Share = Annotated[float, Field(ge=0, le=1)]


def Seam(kind: str, key: str):  # noqa: N802 (a type)
    """A str naming an implementation of a registry kind: a known name or 'package.module:attr'
    (rollwise.registry); anything else fails validation with the list of known names."""
    return Annotated[str, AfterValidator(lambda v: registry.check(kind, v, key))]


EngineBackendName = Seam("engine", "engine.backend")
GenerateStrategyName = Seam("generator", "generate.strategy")
ProcessVerifierName = Seam("process_verifier", "generate.scope.verifier")
GenerateAgentName = Seam("agent", "generate.agent")
ControlSelectorName = Seam("selector", "control.selector")
ControlInflightName = Seam("inflight", "control.inflight")
ControlGroupSizeName = Seam("group_size", "control.group_size")
ReplayStrategyName = Seam("replay", "replay.strategy")
TrainAdvantageName = Seam("advantage", "train.advantage")
TrainTokenShapingName = Seam("token_shaping", "train.token_shaping")
TrainLossName = Seam("policy_loss", "train.loss")
TrainLossAggName = Seam("aggregation", "train.loss_agg")
TrainKlEstimatorName = Seam("kl", "train.kl_estimator")


class Section(BaseModel):
    # a field's docstring is its description: configs/default.yaml carries it as a comment
    model_config = ConfigDict(extra="forbid", validate_assignment=True,
                              use_attribute_docstrings=True)


class ModelConfig(Section):
    path: str | None = None
    """Local Hugging Face causal-LM folder. None builds the tiny model from the fields below."""
    arch: Literal["qwen2", "llama"] = "qwen2"
    """The built-in model's architecture (with model.path unset): a Qwen2- or Llama-shaped causal
    LM."""
    hidden_size: int = Field(128, gt=0)
    """The built-in model's width (hidden size)."""
    num_layers: int = Field(4, gt=0)
    """The built-in model's transformer layers."""
    num_heads: int = Field(4, gt=0)
    """The built-in model's attention (query) heads."""
    num_kv_heads: int = Field(2, gt=0)
    """The built-in model's key/value heads (grouped-query attention: a divisor of num_heads)."""
    intermediate_size: int = Field(512, gt=0)
    """The built-in model's MLP width."""
    max_positions: int = Field(64, gt=0)
    """The built-in model's longest sequence, prompt and response together (tokens)."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """The weights' dtype for the trainer and (sync.engine_dtype=same) the engine. bfloat16 and
    float16 train with float32 master weights and optimizer state. auto: bfloat16 where
    run.device multiplies it natively (a CUDA GPU with bf16; a CPU with AVX512-BF16 or AMX,
    where bf16 products run at about twice float32's rate), else float32; the run's saved
    config records which."""


class WorkedConfig(Section):
    """The running-sum task (task.name=worked, rollwise.tasks.worked)."""
    terms: list[int] = [3, 30]
    """Fewest and most terms in a chain, drawn log-uniformly (most chains short, a few long):
    a response writes a line per term after the first."""
    max_digits: int = Field(2, ge=1, le=9)
    """Each term has 1 to max_digits digits."""
    subtract: Share = 0.3
    """Share of the terms after the first that are subtracted (when the total stays >= 0)."""
    credit: Literal["all", "prefix"] = "all"
    """The reward. all: 1 when every step line and the boxed answer are right, else 0.
    prefix: half the share of the solution's lines (the steps, then the box) written right
    before the first wrong or missing one, so two wrong answers that fail at different lines
    differ and finishing right is worth twice any of them; 1 still only when all are right,
    so held-out pass@1 (a reward of 1) is the same test."""
    teacher: Literal["slip", "wrong_facts"] = "slip"
    """How the warm start's noisy worked solutions (sft.noise of them) go wrong. slip: one
    line's total off by one, carried on (the warm start is unsure at single steps);
    wrong_facts: the total off by one after every line whose total and term end in one of
    `wrong_facts` digit pairs (drawn from task.seed), so with sft.noise > 0.5 the warm start
    mostly writes those sums wrong and RL relearns them one by one."""
    wrong_facts: int = Field(10, ge=1, le=100)
    """teacher=wrong_facts: how many (total's last digit, term's last digit) pairs it gets
    wrong, of 100 (90 with one-digit terms, which never end in 0)."""
    prompt: str = ("Compute {chain} step by step: write each running total on its own line "
                   "as 'a + b = c', then the final answer as \\boxed{answer}.")
    """The problem's text; '{chain}' is replaced by the terms."""

    @field_validator("terms")
    @classmethod
    def _check_terms(cls, v):
        if len(v) != 2 or not 2 <= v[0] <= v[1]:
            raise ValueError(f"{v}: give [fewest, most] terms with 2 <= fewest <= most")
        return v

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v):
        if "{chain}" not in v:
            raise ValueError("must contain '{chain}' where the problem's terms go")
        return v


class TaskConfig(Section):
    name: str = "arith"
    """'arith' (built-in tiers), 'worked' (running sums written step by step, long answers:
    configs/smollm2-long.yaml), 'calc' (multi-turn, with a calculator: configs/calc.yaml),
    'gym:<reasoning-gym dataset>', 'gym' (a weighted mix of the datasets in task.gym), or
    'file' (JSONL/Parquet)."""
    gym: dict[str, dict[str, Any] | None] = {}
    """reasoning-gym datasets and their generator settings (the fields of each dataset's
    config class) with an optional weight, e.g. {chain_sum: {weight: 2, max_terms: 3},
    products: {max_digits: 1}}: task.name=gym mixes them in proportion to their weights;
    task.name=gym:<dataset> takes its settings from here. Checked against reasoning-gym when
    the config is validated, before any work (rollwise.gym_settings)."""
    tiers: dict[str, float] = {"add2": 0.35, "sub2": 0.35, "add3": 0.15, "chain": 0.15}
    """Built-in tiers and their share of the train mix (see rollwise.tasks.arith.TIERS)."""
    train_size: int = Field(20000, gt=0)
    """Training prompts generated for the built-in tasks (arith, worked, calc, ...)."""
    eval_size: int = Field(400, gt=0)
    """Held-out prompts: split across tiers in the same shares as the train mix; for a file or
    dataset without eval rows, drawn at random (task.seed) from its rows, at most a fifth."""
    seed: int = 1234
    """Problem-set seed; independent of run.seed so every run sees the same problems."""
    filler_mean: float = Field(0.0, ge=0)
    """Built-in tiers: mean number of '.' "thinking" tokens before the answer in the worked
    solutions (geometric), which makes response lengths long-tailed; 0: none."""
    filler_tail: float = Field(0.0, ge=0, le=1)
    """Built-in tiers: the share of worked solutions that think long instead: ',' filler,
    geometric with mean filler_tail_mean (a heavy tail: a few responses run far longer)."""
    filler_tail_mean: float = Field(0.0, ge=0)
    """Built-in tiers: mean length of the long ',' filler runs of filler_tail (geometric); needed
    when filler_tail > 0."""
    stepped_teacher: Literal["forgets_carries", "wrong_facts"] = "forgets_carries"
    """How the stepped tiers' noisy worked solutions (sft.noise of them) go wrong: every carry
    forgotten (one rule to relearn), or the sum off by one wherever a column adds one of
    `wrong_facts` digit pairs drawn from task.seed (many facts, each relearned alone)."""
    wrong_facts: int = Field(30, ge=1, le=100)
    """stepped_teacher = wrong_facts: how many digit pairs the teacher adds off by one."""
    worked: WorkedConfig = WorkedConfig()

    @model_validator(mode="after")
    def _check_gym(self):
        if self.gym and not (self.name == "gym" or self.name.startswith("gym:")):
            raise ValueError(f"task.gym sets reasoning-gym datasets, but task.name = "
                             f"{self.name}: set task.name=gym (a mix) or gym:<dataset>")
        return self

    @model_validator(mode="after")
    def _check_filler_tail(self):
        if self.filler_tail > 0 and self.filler_tail_mean <= 0:
            raise ValueError(f"task.filler_tail = {self.filler_tail} needs task.filler_tail_mean "
                             "> 0 (the long runs' mean length); set it, or filler_tail=0")
        return self

    path: str | None = None
    """For name='file': a .jsonl or .parquet file of (prompt, answer) rows. A prompt is a
    string or a list of chat messages [{"role", "content"}, ...] (TRL's conversational format,
    verl's Parquet files)."""
    eval_path: str | None = None
    """For name='file': a .jsonl or .parquet file of held-out rows; None: held-out rows are drawn
    from task.path (task.eval_size of them)."""
    prompt_field: str = "prompt"
    """The rows' prompt column (text or chat messages), or a dotted path into one."""
    answer_field: str = "answer"
    """A column, or a dotted path into one (verl's Parquet: reward_model.ground_truth)."""
    chat_template: Literal["auto", "on", "off"] = "auto"
    """auto: render prompts with the tokenizer's chat template (and the generation prompt) when
    it has one, except the built-in arith tiers, which keep their plain prompts; on: always
    (an error when the tokenizer has none); off: plain text."""
    system_prompt: str | None = None
    """A system message put before each prompt that has none (plain text: its first line)."""
    prompt_template: str | None = None
    """Wraps the (last user message of the) prompt; '{prompt}' marks where it goes, e.g.
    '{prompt} Put the final answer in \\boxed{}.'"""
    answer_format: Literal["auto", "answer_tag", "boxed", "answer_is", "last_number",
                           "last_line"] = "auto"
    """How reasoning-gym and file tasks find the answer in a response (filter.extract
    overrides it): auto tries <answer>...</answer>, \\boxed{}, "the answer is", then the last
    line. The built-in arith tiers keep their own extraction."""

    @field_validator("chat_template", mode="before")
    @classmethod
    def _on_off(cls, v):  # YAML reads a bare on/off as a boolean
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("prompt_template")
    @classmethod
    def _check_template(cls, v):
        if v is not None and "{prompt}" not in v:
            raise ValueError("must contain '{prompt}' where the problem's text goes, e.g. "
                             "'{prompt} Put the final answer in \\boxed{}.'")
        return v


class EngineConfig(Section):
    backend: EngineBackendName = "builtin"
    """builtin (rollwise's engine), vllm (needs the vllm extra), or 'package.module:factory'
    called as factory(cfg, model, tokenizer, run_dir)."""
    max_batch: int = Field(1024, gt=0)
    """KV slots: most sequences decoded at once; the rest wait and take freed slots."""
    segment: int = Field(16, gt=0)
    """The engine reports each sequence's new tokens every `segment` tokens and at its end."""
    graph: Literal["auto", "compile", "eager", "off"] = "auto"
    """builtin: how decode steps run. compile: the decode graph (a Llama-family forward over
    the slot cache, sampling on the device), torch.compile'd on a CPU and captured as CUDA
    graphs on a GPU; compiled code is cached on disk, so later runs skip the compile. eager:
    the decode graph uncompiled. off: the Hugging Face model's own forward for every step.
    auto: the decode graph for the models it reproduces (checked on the live weights at the
    first step), compiled from 10 M parameters up (below, compiling costs more than it
    saves); off for the rest (the reason is logged)."""
    kv_budget_tokens: int | None = Field(None, gt=0)
    """Cap on KV-cache positions (slots x length); None: bounded by max_batch only.
    vllm: the KV cache is sized to hold this many tokens."""
    kv_budget_bytes: int | None = Field(None, gt=0)
    """The same cap in bytes of K and V (2 x layers x kv heads x head dim x dtype size per
    token); give this or kv_budget_tokens. vllm: its kv_cache_memory_bytes."""
    prefix_cache_tokens: int | Literal["auto"] = "auto"
    """builtin: K/V positions kept from finished requests for later requests that start with
    the same tokens (an agent's next turn prefills only the environment's tokens; a TRACE
    continuation reuses its root's prefix). Emptied at each round and each weight update.
    0: off. auto: when generate.env is set (episodes), room for a step's episodes
    (prompts_per_step x group_size x 2 x the episode's token limit); else off. vllm always
    uses its own prefix cache."""
    share_prefix: bool = False
    """builtin: a request that starts with the same ids as a running one (admitted under the
    current weights) copies those K/V positions from its slot and prefills only the rest, as
    vLLM's prefix caching does for live requests: APRIL's resumed answers share their prompt's
    prefill within a group. Results differ from a full prefill by float rounding only."""
    gpu_memory_utilization: float = Field(0.45, gt=0, lt=1)
    """vllm on a GPU beside the trainer: the share of the device's memory vLLM takes (weights
    and KV cache); the trainer uses the rest. Ignored on CPU."""
    sleep_level: Literal[0, 1, 2] = 0
    """vllm on a GPU: sleep while the trainer runs (1: weights offloaded to CPU, KV cache freed;
    2: both freed), waking for the weight update after each step. 0: stay awake (memory split
    by gpu_memory_utilization alone)."""

    @field_validator("graph", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        """YAML reads a bare `off` as false."""
        return "off" if value is False else value

    @model_validator(mode="after")
    def _check_kv_budget(self):
        if self.kv_budget_tokens and self.kv_budget_bytes:
            raise ValueError("engine.kv_budget_tokens and engine.kv_budget_bytes both set: give "
                             "one of them")
        if self.prefix_cache_tokens != "auto" and 0 < self.prefix_cache_tokens < 16:
            raise ValueError(f"engine.prefix_cache_tokens = {self.prefix_cache_tokens}: give 0 "
                             f"(off), auto, or at least 16 (one block of the cache)")
        if self.prefix_cache_tokens != "auto" and self.prefix_cache_tokens < 0:
            raise ValueError(f"engine.prefix_cache_tokens = {self.prefix_cache_tokens}: give 0 "
                             f"(off), auto, or at least 16")
        return self


class TraceConfig(Section):
    """TRACE (generate.strategy=trace; docs/methods.md#trace, rollwise.agents.trace_rollout)."""
    roots: int = Field(2, ge=1)
    """Episodes per problem played from the prompt first; the rest of the group size goes
    to the anchors the allocation picks."""
    allocation: Literal["trace", "root"] = "trace"
    """trace: by predicted P(mixed) over the prompts and turn prefixes; root: every
    continuation from the prompts (the i.i.d. baseline at the same budget)."""
    budget: Literal["tokens", "episodes"] = "tokens"
    """What allocation=trace spends, per problem, beyond its roots: tokens (the sampled tokens
    root-only allocation would spend there, the group size less the roots times the mean of
    the problem's roots; each continuation costs what its root sampled after the cut: TRACE's
    equal sampling cost) or episodes (the group size less the roots, however short)."""
    predictor_lr: float = Field(0.5, gt=0)
    """Learning rate of TRACE's online predictor of a turn prefix's success, which picks where the
    continuations go."""


class LatrConfig(Section):
    """LATR (generate.strategy=latr; docs/methods.md#latr). Defaults: the paper's math setting."""
    tau_abs: float = Field(0.15, ge=0, le=1)
    """Branch on the second-best token when its probability exceeds this ..."""
    tau_rel: float = Field(0.25, ge=0, le=1)
    """... and it is within this of the best token's."""
    ages: list[int] = [20, 30, 50]
    """Decode steps after a branch's birth at which it is compared with its parent."""
    similarity: float = Field(0.4, ge=0, le=1)
    """Prune a child whose newest r tokens are within this normalised edit distance of its
    parent's."""
    force_exit: int = Field(1024, gt=0)
    """Decode step at which the tree phase ends whatever the branch count."""
    eta: dict[int, float] = {0: 1.0, 100: 0.75, 200: 0.5, 300: 0.25}
    """Training step -> share of each group drawn from the tree (the rest i.i.d.)."""


class EchoConfig(Section):
    """ECHO (generate.strategy=echo; docs/methods.md#echo). Defaults: the released config. The
    entropy is that of the renormalised top-`top_k` distribution (at most ln top_k nats), so a
    small top_k, or a small model with few plausible tokens per step, wants a lower
    entropy_threshold (and entropy_floor below it)."""
    top_k: int = Field(10, ge=2)
    """Top-k log-probabilities each sequence reports per token; the entropy and confidence
    statistics are computed over them."""
    roots: int = Field(2, ge=1)
    """Sampled sequences per prompt that branch; the group is filled to its size once the tree
    is done (generate.echo.fill)."""
    min_position: int = Field(4, ge=0)
    """The first response token at which a sequence may branch."""
    entropy_threshold: float = Field(3.5, gt=0)
    """Top-k entropy (nats) at or above which a sequence may branch."""
    entropy_floor: float = Field(1.0, ge=0)
    """The width rule's entropy origin: w = 1 + 2 (H - floor) / (threshold - floor) - ...
    (the released code's 1.0; must be below entropy_threshold)."""
    conf_threshold: float = Field(1.2, gt=0)
    """Group confidence (C_g, the mean top-k confidence over group_window tokens) at or below
    which a sequence may branch (C* of the width rule)."""
    delta_threshold: float = 0.2
    """Entropy rise (the token's entropy less the mean of the last delta_window) at or above which
    a sequence may branch."""
    max_width: int = Field(4, ge=1)
    """Most children a branch point gets (the width rule's clip)."""
    group_window: int = Field(4, ge=1)
    """Tokens averaged into the group confidence C_g."""
    tail_window: int = Field(8, ge=1)
    """Tokens averaged into the tail confidence C_tail (the conf_falling prune rule)."""
    delta_window: int = Field(4, ge=1)
    """Earlier tokens whose mean entropy a token's entropy rise is measured from."""
    min_group_conf: float = 0.4
    """Prune rule min_conf: a sequence is cut once its running minimum of C_g falls below this."""
    tail_conf: float = 1.0
    """Prune rule conf_falling: a sequence is cut when C_tail fell 3 tokens in a row and is at or
    below this."""
    delta_rise: float = 0.5
    """Prune rule entropy_rising: a sequence is cut when its entropy rise grew 3 tokens in a row
    and is above this."""
    prune: bool = True
    """Apply the three prune rules (cut sequences whose confidence collapses); False grows every
    branch to its end."""
    fill: Literal["iid", "dora"] = "iid"
    """How the group is filled once the tree is done: iid (fresh samples from the prompt) or
    dora (continuations of the tree's finished sequences' openings, spread over the openings
    by DORA's direction-level rule, as `rollwise eval --search dora`)."""
    fill_prefix_tokens: int = Field(8, ge=1)
    """fill = dora: a sequence's direction is its first this many response tokens."""
    fill_temperature: float = Field(0.2, gt=0)
    """fill = dora: softmax temperature over the sequences' mean token log-probabilities."""

    @model_validator(mode="after")
    def _floor_below_threshold(self):
        if self.entropy_floor >= self.entropy_threshold:
            raise ValueError(
                f"entropy_floor ({self.entropy_floor}) must be below entropy_threshold "
                f"({self.entropy_threshold}): the width rule divides by their difference; "
                f"set generate.echo.entropy_floor lower (e.g. a tenth of the threshold)")
        return self


class ScopeConfig(Section):
    """SCOPE's step-wise rectification of failed rollouts (docs/methods.md#scope)."""
    verifier: ProcessVerifierName | None = None
    """The process verifier that finds a failed response's first wrong step and writes the
    right one: columns (the stepped tiers' scratchpads), equations (every `a + b = c` in
    free text), worked (the worked task's running totals, line by line), or
    'package.module:factory' (rollwise.stages.filter.process); None: off."""
    per_group: int = Field(2, ge=1)
    """Failed rollouts rectified per group at most (those with the longest right prefix)."""
    max_solved: float = Field(0.5, ge=0, le=1)
    """Only groups whose share of correct rollouts is at most this are rectified: where most
    rollouts are right, a failure is itself the signal."""


class NudgeConfig(Section):
    """NudgeRL's strategy contexts (generate.strategy=nudge; docs/methods.md#nudgerl)."""
    contexts: list[str] = []
    """Short strategy hints, e.g. "work from the last digit"; with contexts_file, both."""
    contexts_file: str | None = None
    """A text file with one context per line (blank lines and '#' lines skipped)."""
    per_prompt: int = Field(2, ge=1)
    """Contexts a prompt's group is split over (the group's rollouts shared out evenly)."""
    plain_share: float = Field(0.5, ge=0, le=1)
    """Each rollout is asked plainly, without its context, with this probability."""
    draw: Literal["random", "sequential"] = "random"
    """How a prompt's contexts are drawn: at random, or the list in turn."""
    template: str = "{prompt}\n\nStrategy: {context}"
    """How a context joins the prompt's last user message ({prompt} and {context})."""

    @model_validator(mode="after")
    def _check_template(self):
        if "{prompt}" not in self.template or "{context}" not in self.template:
            raise ValueError(f"generate.nudge.template = {self.template!r}: it must hold "
                             f"{{prompt}} and {{context}}")
        return self


class GenerateConfig(Section):
    strategy: GenerateStrategyName = "group"
    """How trajectories are proposed: group (i.i.d. samples per prompt), latr or echo (tree
    rollouts), episode (multi-turn agent episodes), trace (episodes with TRACE's turn-prefix
    allocation), cod (Connect-the-Dots pack plays), agent (agents written against the OpenAI
    client, generate.agent), or 'package.module:factory' called as
    factory(cfg, tokenizer) (rollwise.stages.generate)."""
    group_size: int = Field(8, ge=1)
    """Responses sampled per prompt: the group whose rewards GRPO compares."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the rollouts."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p; 1 disables
    it."""
    top_k: int = Field(0, ge=0)
    """0 disables top-k."""
    max_new_tokens: int = Field(8, gt=0)
    """Tokens per response; per model turn in an agent episode."""
    env: str | None = None
    """generate.strategy=episode: the environment, by name (tools) or
    'package.module:factory' called as factory(cfg, problem) (rollwise.agents.env);
    strategy=cod: the pack environment (remap; rollwise.agents.pack_play)."""
    tools: list[str] = []
    """The tools an episode's environment offers: calculator, python, or
    'package.module:function' (a typed function with a docstring)."""
    tool_format: Literal["auto", "hermes", "json", "plain"] = "auto"
    """How the tools environment reads calls: hermes (<tool_call> JSON), json (Llama 3),
    plain (name(argument), for the character model); auto tries them in that order."""
    max_turns: int = Field(4, ge=1)
    """Model turns per agent episode."""
    agent: GenerateAgentName | None = None
    """generate.strategy=agent: 'package.module:function', called as function(problem,
    client) with an OpenAI client for its episode alone; returns a reward (filter.reward=env)
    or the final answer (a str, scored by filter.reward) (rollwise.serve.agent)."""
    agent_timeout_s: float = Field(300.0, gt=0)
    """An agent episode's time; past it the episode fails (stored, never trained)."""
    agent_concurrency: int = Field(64, ge=1)
    """Agent episodes played at once (their calls are batched by the engine)."""
    max_episode_tokens: int | None = Field(None, gt=0)
    """Tokens per agent episode, the environment's included; None: max_new_tokens x
    max_turns."""
    latr: LatrConfig = LatrConfig()
    echo: EchoConfig = EchoConfig()
    trace: TraceConfig = TraceConfig()
    scope: ScopeConfig = ScopeConfig()
    nudge: NudgeConfig = NudgeConfig()


class SandboxConfig(Section):
    """Limits for model-written code (filter.reward=code); see docs/filter.md."""
    timeout_s: float = Field(2.0, gt=0)
    """Wall clock per test run; then the program's whole process group is killed."""
    cpu_s: int = Field(2, gt=0)
    """CPU seconds a test run may use (RLIMIT_CPU)."""
    memory_mb: int = Field(512, gt=0)
    """Address space a test run may map, in MiB (RLIMIT_AS)."""
    max_processes: int = Field(4, gt=0)
    """Processes a test run may have at once (RLIMIT_NPROC): bounds a fork bomb."""
    max_output_kb: int = Field(256, gt=0)
    """Output kept of a test run, in KiB; the rest is cut (a flood of output cannot fill memory)."""
    guard: bool = True
    """The in-interpreter audit-hook guard on top of the kernel limits."""


class JudgeConfig(Section):
    """An LLM judge as a reward (filter.reward=judge): a model asked whether a response is right."""
    model: str | None = None
    """Hugging Face folder of the judge model; None uses the engine the loop attaches."""
    rubric: str | None = None
    """Prompt template with {prompt} {answer} {response} {flawed}; None: the built-in one."""
    fapo: bool = False
    """FAPO's three-way verdict: correct +1, correct but flawed 0, wrong -1."""
    max_new_tokens: int = Field(64, gt=0)
    """Tokens the judge writes for its verdict at most."""


class FilterConfig(Section):
    reward: str | dict[str, float] = "exact"
    """A verifier, or {verifier: weight} for a weighted composite (channels stay separate in
    sample.rewards). Verifiers: exact, math (math-verify), gym (reasoning-gym), code,
    format, length, judge, majority (test-time RL, no labels), or 'package.module:function'."""
    workers: int = Field(2, ge=0)
    """Processes for isolated verifiers (math, gym, code, user functions); 0: in-process."""
    timeout_s: float = Field(10.0, gt=0)
    """Per-sample limit in the worker processes; an overrun fails that sample."""
    extract: list[str] = []
    """Answer extraction order from task, boxed, answer_is, last_number, last_line;
    [] uses the task's own extractor."""
    format_pattern: str | None = None
    """format channel: the stripped response must fullmatch this regex (None: any answer)."""
    length_max: int = Field(8, gt=0)
    """length channel: the response length (tokens) at which DAPO's soft overlong penalty reaches
    -1."""
    length_buffer: int = Field(2, ge=0)
    """length channel: DAPO's soft overlong penalty, 0 up to length_max - length_buffer tokens,
    then falling linearly to -1 at length_max (set length_max to generate.max_new_tokens).
    Weigh it in filter.reward, e.g. {exact: 1, length: 1}: the one place it is configured."""
    code_reward: Literal["all", "fraction"] = "all"
    """code channel: 1 only when every test passes (all), or the share of tests passed
    (fraction)."""
    sandbox: SandboxConfig = SandboxConfig()
    judge: JudgeConfig = JudgeConfig()

    @field_validator("reward")
    @classmethod
    def _check_reward(cls, v):
        for name in ([v] if isinstance(v, str) else v):
            registry.check("verifier", name, "filter.reward")
        return v

    majority_min_ratio: float = Field(0.0, ge=0, lt=1)
    """majority channel: a group gets a pseudo-label only when its most common answer holds
    more than this share of its samples (0.5: a strict majority; 0: the plurality, as TTRL).
    Ties never get a label."""
    drop_equal_reward_groups: bool = True
    """Drop groups whose rewards are all equal: their GRPO advantages are zero."""


class DPSConfig(Section):
    """DPS, Dynamics-Predictive Sampling (control.selector=dps; docs/methods.md#dps)."""
    candidate_ratio: float = Field(4.0, ge=1)
    """Candidate pool size as a multiple of prompts_per_step."""
    prior: Literal["flat", "stability", "progress", "local"] = "flat"
    """Dirichlet prior of the transition counts (maoyixiu/DPS hmm_prior_alpha): flat (all 1),
    stability (staying in a state is twice as likely), progress, local."""
    decay: float = Field(1.0, ge=0, le=1)
    """Per-update decay of the per-prompt counts toward their prior."""


class ThompsonConfig(Section):
    """MoPPS Beta-Bernoulli Thompson sampling (control.selector=thompson)."""
    target_success: float = Field(0.5, gt=0, lt=1)
    """Pick prompts whose sampled success rate is closest to this."""
    decay: float = Field(1.0, ge=0, le=1)
    """Per-update decay of the per-prompt counts toward their prior."""


class VadeConfig(Section):
    """VADE variance-aware selection (control.selector=vade; docs/methods.md#vade)."""
    fast_decay: float = Field(0.8, gt=0, le=1)
    """Per-step decay of a prompt's evidence (its recent groups: follows a moving policy)."""
    slow_decay: float = Field(0.98, gt=0, le=1)
    """Per-step decay of its long-run success rate, the prior a rarely drawn prompt falls
    back to."""
    prior_strength: float = Field(4.0, ge=0)
    """Pseudo-counts the long-run rate carries as the prompt's prior (at most)."""
    prior: list[Annotated[float, Field(gt=0)]] = Field([1.0, 1.0], min_length=2, max_length=2)
    """Beta prior [a, b] of every prompt's success rate."""


class InsightConfig(Section):
    """InSight weighted mutual-information selection (control.selector=insight;
    docs/methods.md#insight)."""
    k: int | None = Field(None, ge=1)
    """Rollouts the score looks ahead to (the mutual information of the next k outcomes);
    None: generate.group_size."""
    decay: float = Field(1.0, ge=0, le=1)
    """Per-observation decay of a prompt's counts toward the prior (as control.thompson)."""
    prior: list[Annotated[float, Field(gt=0)]] = Field([1.0, 1.0], min_length=2, max_length=2)
    """Beta prior [a, b] of every prompt's success rate."""


class AprilConfig(Section):
    """APRIL partial rollouts (control.inflight=april; docs/methods.md#april)."""
    over_provision: float = Field(2.0, ge=1)
    """Groups in flight per group wanted."""


class SGPOConfig(Section):
    """sGPO group sizes (control.group_size=sgpo; docs/methods.md#sgpo)."""
    group_min: int = Field(2, ge=1)
    """The smallest group sGPO gives a prompt (the clip of G = 1/p from below; see group_max)."""
    group_max: int = Field(16, ge=1)
    """The clip of G = 1/p (a group of one has no advantage under GRPO)."""
    profile_samples: int = Field(8, ge=1)
    """Samples per prompt in the profiling pass (k)."""
    profile_prompts: int | None = Field(None, gt=0)
    """Profile (and then train on) this many prompts drawn from the pool; None: all."""
    unsolvable_keep: float = Field(0.1, ge=0, le=1)
    """Share of the never-solved prompts (p = 0) kept in the pool."""

    @model_validator(mode="after")
    def _check_clip(self):
        return _check_group_clip(self, "sgpo")


class DARSConfig(Section):
    """DARS extra rollouts for hard prompts (control.group_size=dars; docs/methods.md#dars)."""
    schedule: Literal["et", "hw"] = "et"
    """Equal-treatment (et) or hardness-weighted (hw) extra rollouts."""
    max: int | None = Field(None, ge=1)
    """Most samples a group may reach; None: 4 x (et) or 8 x (hw) generate.group_size, the
    paper's 32 and 64 at group_size 8."""


class XRPOConfig(Section):
    """XRPO's rollout allocator (control.group_size=xrpo; docs/methods.md#xrpo)."""
    base: int = Field(4, ge=2)
    """Rollouts every selected prompt gets first; the rest of the step's budget
    (generate.group_size - base per prompt) goes by priority."""
    max: int | None = Field(None, ge=2)
    """Most rollouts one prompt may hold; None: 2 x generate.group_size."""
    alpha: float = Field(0.05, gt=0, lt=1)
    """The t-interval's level is 1 - alpha."""
    bonus: float = Field(0.1, ge=0)
    """lambda of the exploration bonus lambda sqrt(log(1 + T) / n)."""


class CuresConfig(Section):
    """CurES selection and rollout allocation (control.selector=cures,
    control.group_size=cures; docs/methods.md#cures)."""
    temperature: float = Field(0.1, gt=0)
    """Selection weight exp(sqrt(p (1 - p)) / temperature): a prompt at p = 1/2 is e^(0.5 /
    temperature) times as likely as a solved one (the public code's 100 (successes + 1) is
    uniform sampling in effect)."""
    min: int = Field(2, ge=1)
    """The fewest rollouts one prompt gets (see max)."""
    max: int | None = Field(None, ge=1)
    """Rollouts one prompt gets at least and at most; None: 2 x generate.group_size."""
    gradient: Literal["embedding", "none"] = "embedding"
    """embedding: measure each response's gradient norm over the input embeddings after the
    step (the paper's E[g^2] terms); none: every norm 1, sigma = sqrt(p (1 - p))."""
    grad_samples: int = Field(4, ge=1)
    """Responses per group whose gradient norm is measured."""


class V0Config(Section):
    """V0 success-rate prediction before generation, and allocation by it
    (control.group_size=v0; docs/methods.md#v0)."""
    history: int = Field(1024, ge=1)
    """Observed groups kept (the latest)."""
    bandwidth: float = Field(0.1, gt=0)
    """Kernel width on the cosine similarity of prompts: exp((cos - 1) / bandwidth)."""
    decay: float = Field(0.9, gt=0, le=1)
    """Per-step weight decay of older groups (the policy moves)."""
    prior_strength: float = Field(2.0, ge=0)
    """Pseudo-counts of the history's overall success rate in every prediction."""
    min: int = Field(2, ge=1)
    """The fewest rollouts one prompt gets (see max)."""
    max: int | None = Field(None, ge=1)
    """Rollouts one prompt gets at least and at most; None: 2 x generate.group_size."""


class IclSeedingConfig(Section):
    """XRPO's in-context seeding of stuck prompts (docs/methods.md#xrpo)."""
    exemplars: int = Field(0, ge=0)
    """Solved training problems put before a stuck prompt; 0: off."""
    after: int = Field(2, ge=1)
    """A prompt is stuck after this many groups in a row with no solved rollout."""
    max_prompt_tokens: int = Field(512, ge=1)
    """Exemplars are dropped until the seeded prompt is at most this long."""


class ArrolConfig(Section):
    """ARRoL online pruning (control.inflight=arrol; docs/methods.md#arrol)."""
    checkpoint: int = Field(8, ge=1)
    """Response tokens (T_p) after which the quality head scores a rollout."""
    keep: float = Field(0.5, gt=0, le=1)
    """Share of the over-sampled rollouts that survive (kappa): a group of G is sampled as
    ceil(G / kappa) and pruned back to G at the checkpoint."""
    rho: float = Field(0.5, ge=0, le=1)
    """Target share of positives among the survivors (the top rho G by head score are kept
    with the bottom (1 - rho) G)."""
    explore: float = Field(0.1, ge=0, le=1)
    """Share of groups pruned at random instead of by the head, so the head also learns from
    an unselected sample."""
    lr: float = Field(0.01, gt=0)
    """Learning rate of the quality head (logistic regression, Adam)."""


class DuetConfig(Section):
    """DUET budget allocation and marker-gated aborts (control.inflight=duet;
    docs/methods.md#duet)."""
    budget: float = Field(1.0, gt=0)
    """Rollouts per step as a share of prompts_per_step x group_size."""
    group_min: int = Field(2, ge=1)
    """The fewest rollouts a prompt that gets any is given (see group_max)."""
    group_max: int = Field(16, ge=1)
    """Rollouts a prompt gets: the most informative get group_min each while the budget
    lasts, and no prompt more than group_max."""
    horizon: int = Field(32, ge=1)
    """Tokens by which a rollout is expected to show its answer marker (see grace)."""
    grace: int = Field(8, ge=0)
    """A rollout with no answer marker after horizon + grace tokens is aborted (or kept with
    probability keep_prob and weighted by its inverse)."""
    keep_prob: float = Field(0.05, gt=0, le=1)
    """Probability that a rollout past horizon + grace with no marker is kept, weighted by 1 /
    keep_prob, instead of aborted."""
    after_marker: int = Field(8, ge=0)
    """Tokens a rollout may run on after its answer marker appears."""
    marker: str | None = None
    """A regex whose match in the response so far is the answer marker (e.g. '\\\\boxed\\{');
    None: the task's answer extractor finding an answer is the marker."""

    @field_validator("marker")
    @classmethod
    def _check_marker(cls, v):
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"not a regular expression ({e}): {v!r}") from None
        return v

    @model_validator(mode="after")
    def _check_clip(self):
        return _check_group_clip(self, "duet")


def _check_group_clip(section, name: str):
    if section.group_min > section.group_max:
        raise ValueError(f"control.{name}.group_min = {section.group_min} > "
                         f"control.{name}.group_max = {section.group_max}: needs min <= max")
    return section


# Keys that moved into a method's own section: the old flat name stops with the new one.
_CONTROL_MOVED = {
    "candidate_ratio": "control.dps.candidate_ratio", "dps_prior": "control.dps.prior",
    "decay": "control.dps.decay or control.thompson.decay",
    "target_success": "control.thompson.target_success",
    "over_provision": "control.april.over_provision",
    "group_min": "control.sgpo.group_min or control.duet.group_min",
    "group_max": "control.sgpo.group_max or control.duet.group_max",
    **{k: f"control.sgpo.{k}" for k in ("profile_samples", "profile_prompts",
                                         "unsolvable_keep")},
    "dars_schedule": "control.dars.schedule", "dars_max": "control.dars.max",
    **{f"arrol_{k}": f"control.arrol.{k}" for k in ArrolConfig.model_fields},
    **{f"duet_{k}": f"control.duet.{k}" for k in DuetConfig.model_fields},
}


class ControlConfig(Section):
    selector: ControlSelectorName = "uniform"
    """uniform; thompson (MoPPS Beta-Bernoulli, control.thompson.*); dps (Dynamics-Predictive
    Sampling, control.dps.*); vade (variance-aware Thompson sampling with a two-scale decay,
    control.vade.*); insight (weighted mutual information, control.insight.*); cures
    (softmax over sqrt(p (1 - p)), control.cures.*); or 'package.module:factory' called as
    factory(cfg) (rollwise.stages.control)."""
    prompts_per_step: int = Field(64, gt=0)
    """Prompts a training step draws (each gets generate.group_size responses, or what
    control.group_size allots)."""
    dps: DPSConfig = DPSConfig()
    thompson: ThompsonConfig = ThompsonConfig()
    vade: VadeConfig = VadeConfig()
    insight: InsightConfig = InsightConfig()
    cures: CuresConfig = CuresConfig()
    icl_seeding: IclSeedingConfig = IclSeedingConfig()
    baseline: Literal["none", "running", "v0"] = "none"
    """A group-free baseline put in each sample's meta before training (what
    train.advantage=mssr subtracts): running (the prompt's own decayed mean reward, the run's
    mean as its prior) or v0 (predicted from similar prompts, control.v0.*)."""
    baseline_decay: float = Field(0.8, gt=0, le=1)
    """running: per-step decay of a prompt's earlier rewards."""
    baseline_prior: float = Field(2.0, ge=0)
    """running: pseudo-counts of the run's mean reward in every prompt's baseline."""
    inflight: ControlInflightName = "none"
    """In-flight control over any generator. none: every request runs to its end; april:
    partial rollouts (stop at prompts_per_step complete groups, pause the rest, resume them
    first next step); arrol (over-sample, prune at a checkpoint by a learned quality head to
    correctness-balanced survivors); duet (a token budget allocated across prompts by their
    informativeness, and a marker-gated abort); or 'package.module:factory' called as
    factory(cfg)."""
    april: AprilConfig = AprilConfig()
    arrol: ArrolConfig = ArrolConfig()
    duet: DuetConfig = DuetConfig()
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: refill until prompts_per_step groups have mixed rewards."""
    max_rounds: int = Field(8, ge=1)
    """Dynamic sampling: most generation rounds per step; after the last, the step trains on
    the mixed groups it has."""
    refill: Literal["missing", "full"] = "missing"
    """Dynamic sampling: each round after the first generates only the groups still missing
    (missing), or a full prompts_per_step again as verl's DAPO recipe does with
    data.gen_batch_size = train_batch_size (full; the DPS paper's baseline, with
    max_rounds = 4). Mixed groups beyond the batch are dropped as batch_full."""

    group_size: ControlGroupSizeName = "fixed"
    """Samples per prompt (rollwise.stages.control.group_size): fixed (generate.group_size);
    sgpo (a profiling pass gives each prompt's success rate p; G = 1/p clipped to
    [group_min, group_max]; solved prompts dropped, unsolvable ones subsampled; control.sgpo.*);
    dars (after the first generate.group_size samples, hard prompts get extra ones on DARS's
    schedule; control.dars.*); xrpo (control.xrpo.base samples each, then the rest of the
    step's samples one at a time to the prompts whose mean reward one more sample would pin
    down most, plus a bonus for the less sampled; control.xrpo.*); cures (the step's samples in
    proportion to each prompt's gradient-variance term; control.cures.*); v0 (in proportion to
    p (1 - p) of a success rate predicted from the run's history before generation;
    control.v0.*); or 'package.module:factory' called as factory(cfg)."""
    sgpo: SGPOConfig = SGPOConfig()
    dars: DARSConfig = DARSConfig()
    xrpo: XRPOConfig = XRPOConfig()
    v0: V0Config = V0Config()

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data):
        if isinstance(data, dict):
            moved = [f"control.{k} is now {_CONTROL_MOVED[k]}" for k in data
                     if k in _CONTROL_MOVED]
            if moved:
                raise ValueError("; ".join(moved))
        return data

    @model_validator(mode="after")
    def _check_refill(self):
        if self.refill != "missing" and not self.dynamic_sampling:
            raise ValueError(f"control.refill = {self.refill} applies to dynamic sampling "
                             "only: set control.dynamic_sampling = true, or drop control.refill")
        return self


class ReplayConfig(Section):
    enabled: bool = False
    """Rollout replay (DOTS RR, docs/methods.md#replay): fill `share` of each batch's prompt slots
    with groups drawn from a buffer of recent ones instead of generating them. Pair it with
    train.correction.mode=tis (the decoupled clip) so stale tokens are corrected."""
    strategy: ReplayStrategyName = "buffer"
    """What replay does when enabled: buffer (the DOTS rollout buffer) or
    'package.module:factory' called as factory(cfg) (rollwise.stages.replay)."""
    share: float = Field(0.5, ge=0, lt=1)
    """Share of prompts_per_step taken from the buffer (once it holds enough groups)."""
    capacity: int = Field(512, gt=0)
    """Most groups kept: the latest group of each prompt, the oldest evicted first."""
    max_staleness: int | None = Field(8, ge=0)
    """Never replay a group whose oldest token is more than this many policy versions old."""
    curriculum: str = "none"
    """Pool hook over per-prompt statistics: none, frontier, or 'package.module:function'
    called as fn(pool, stats, step) -> prompts (rollwise.stages.replay.curriculum)."""
    curriculum_keep: float = Field(0.25, gt=0, le=1)
    """frontier: share of the pool kept, closest to a success rate of 1/2."""


class CorrectionConfig(Section):
    """Importance correction for tokens the current policy did not sample
    (rollwise.training.correction): engine mismatch and staleness."""
    mode: Literal["none", "tis", "mis", "icepop"] = "none"
    """'none': the anchor is taken as the behaviour policy; 'tis': loss weight
    min(anchor/behaviour, high); 'mis': drop tokens (or sequences) whose weight leaves
    [low, high]; 'icepop': IcePop's two-sided token mask, 'mis' at level token (its paper's
    band: low 0.5, high 5)."""
    level: Literal["token", "sequence"] = "token"
    """One weight per token, or one per sequence (product of its token ratios)."""
    low: float = Field(0.5, ge=0)
    """The weight's lower bound (mode mis: tokens below it are dropped)."""
    high: float = Field(2.0, gt=0)
    """The weight's upper bound: tis caps the weight here; mis drops tokens above it."""
    anchor: Literal["proximal", "version"] = "proximal"
    """Denominator of the PPO ratio. 'proximal': the trainer's policy at the start of the
    update (AReaL's decoupled objective; the weight corrects mismatch and staleness).
    'version': the trainer's policy at the version that sampled each token (needs snapshots;
    the clip handles staleness and the weight corrects engine mismatch only)."""
    snapshots: int = Field(0, ge=0)
    """Keep the weights of the last N policy versions, so the behaviour ratio of stale tokens
    splits exactly into mismatch and staleness; 0 keeps none."""
    max_staleness: int | None = Field(None, ge=0)
    """Drop tokens sampled more than this many policy versions ago; None keeps all."""
    vcpo_lr: bool = False
    """VCPO: scale each step's learning rate by sqrt(min(1, (ESS/B) / vcpo_rho0))."""
    vcpo_rho0: float = Field(1.0, gt=0)
    """VCPO's reference effective-sample-size ratio rho0: below it the learning rate is scaled
    down."""

    @model_validator(mode="after")
    def _check(self):
        if self.low >= self.high:
            raise ValueError(f"train.correction.low = {self.low} must be below high = "
                             f"{self.high}")
        if self.mode == "icepop" and self.level != "token":
            raise ValueError("train.correction.mode = icepop masks token by token: set "
                             "train.correction.level = token (or mode = mis)")
        if self.anchor == "version" and self.snapshots < 1:
            raise ValueError("train.correction.anchor = 'version' needs train.correction."
                             "snapshots >= 1 (ideally >= max_staleness)")
        return self


class LoraConfig(Section):
    """LoRA adapters (peft) trained in place of the full weights (docs: LoRA guide)."""
    rank: int = Field(0, ge=0)
    """LoRA rank: > 0 trains low-rank adapters (peft) instead of the weights; only they are
    optimized, checkpointed and sent to the engine. 0: full fine-tuning."""
    alpha: float | None = Field(None, gt=0)
    """The adapters' scale is alpha / rank; None: 2 x rank (a scale of 2)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input. Above 0 the trainer's log-probabilities are random
    (the old-policy pass too), so the PPO ratio carries that noise; 0 keeps it exact."""
    targets: list[str] | Literal["all-linear"] | None = "all-linear"
    """Module names (or name suffixes) that get adapters, e.g. [q_proj, v_proj]; 'all-linear':
    every linear layer but the output head (the MLP's as well as attention's: the MLP holds
    most of each layer's weights); None: peft's default for the architecture (q_proj and
    v_proj for Llama and Qwen2)."""


class D3SConfig(Section):
    """D³S dual-level down-sampling (train.downsample=d3s; docs/methods.md#d3s)."""
    sample_start: float = Field(0.5, gt=0, le=1)
    """Share of each group's rollouts trained at the first update (the max-variance subset,
    at least 2)."""
    token_start: float = Field(0.5, gt=0, le=1)
    """Share of the step's remaining tokens trained at the first update (largest |A| H)."""
    relax_steps: int = Field(100, ge=0)
    """Updates over which both shares rise linearly to 1 (0: no down-sampling)."""


class SharpenConfig(Section):
    """XRPO's novelty-aware advantage sharpening (train.advantage=xrpo; docs/methods.md#xrpo)."""
    scale: float = Field(1.0, ge=0)
    """lambda: a correct response's bonus is lambda (1 - eta), eta = exp(s - mean_group s), s
    its mean token log-probability."""
    cap: float = Field(0.5, ge=0)
    """kappa: the bonus is at most kappa times the response's own advantage."""


class TrainNudgeConfig(Section):
    """NudgeRL's objective (train.advantage=nudge and the distillation term;
    docs/methods.md#nudgerl)."""
    inter_weight: float = Field(1.1, ge=0)
    """lambda: a nudged rollout's advantage is (r - its context's mean) + lambda (its
    context's mean - the group's mean); a plain one's r - the group's mean."""
    distill_coef: float = Field(0.1, ge=0)
    """Weight of the distillation term: each nudged response trained again as the answer to
    the plain prompt with the same advantage (0: off)."""


class TrainConfig(Section):
    steps: int = Field(60, ge=0)
    """RL steps (each: generate, score, select, train, sync); 0 only evaluates the initial model."""
    world_size: int = Field(1, ge=1)
    """Trainer ranks: >1 shards the model over that many processes with FSDP2 (gloo on CPU,
    NCCL on GPU; rollwise/training/sharded.py), the micro-batches dealt out over them."""
    advantage: TrainAdvantageName = "grpo"
    """Advantage estimator (rollwise.training.advantages): grpo, dr_grpo, rloo, reinforce_pp,
    reinforce_pp_baseline, mc_grpo, gdpo, cod (Connect-the-Dots: rewards-to-go in sample meta,
    per-slot baselines, RED), trace (TRACE: each reward less its anchor's mean), trace_tree
    (TRACE with per-turn credit: each turn's value after less its baseline before, from the
    whole tree), xrpo (GRPO with XRPO's novelty-aware sharpening, train.sharpen.*), mssr
    (single-rollout: the reward less the sample's group-free baseline, control.baseline),
    nudge (NudgeRL's split into within- and between-context parts, train.nudge.*), or
    'package.module:function'."""
    sharpen: SharpenConfig = SharpenConfig()
    nudge: TrainNudgeConfig = TrainNudgeConfig()
    reward_weights: dict[str, float] = {}
    """GDPO: weight of each reward channel (Sample.rewards); a channel not named weighs 1."""
    advantage_clip: float | None = Field(None, gt=0)
    """Cap |advantage| (MC-GRPO gives |A| = 1000 when a group's MAD is 0); None: no cap."""
    token_shaping: TrainTokenShapingName = "none"
    """Per-token advantage hook: 'none', 'echo' (ECHO's entropy-confidence scaling,
    A_t = A (1 + 0.1 S_t): rollwise/training/confidence.py), or 'package.module:function'
    called as fn(token_advantages (B, T-1), batch). A hook with `needs_policy_stats = True`
    finds the pre-update policy's entropy and top-5 confidence in batch.policy_entropy and
    batch.policy_confidence (one more no-grad pass)."""
    adaptive_clip: Literal["none", "echo"] = "none"
    """'echo': ECHO's confidence-adaptive clip, one eps per sequence on both sides,
    0.05 + 0.15 sigmoid(4 (1 - c_tail)) with c_tail its last 16 tokens' mean top-5
    probability under the pre-update policy; it replaces clip_low and clip_high."""
    loss: TrainLossName = "ppo_clip"
    """Policy loss (rollwise.training.losses): ppo_clip, dual_clip, gspo (wants clip_low/high near
    3e-4/4e-4), or 'package.module:function'."""
    loss_agg: TrainLossAggName = "seq-mean-token-mean"
    """GRPO: seq-mean-token-mean; DAPO: token-mean; Dr.GRPO: seq-mean-token-sum-norm."""
    norm_length: int | None = Field(None, gt=0)
    """Constant divisor of seq-mean-token-sum-norm (Dr.GRPO: the generation budget); None
    uses the longest response of each update."""
    micro_batch_size: int = Field(0, ge=0)
    """Samples per forward/backward; gradients accumulate over each minibatch. 0: whole."""
    max_tokens_per_microbatch: Annotated[int, Field(gt=0)] | Literal["auto"] | None = "auto"
    """Token budget of one forward pass (rows x their longest sequence, padded): micro-batches
    and the log-probability passes are cut to fit it, so a batch of long responses fits in
    memory; the gradient is the same. 'auto': on a CPU, what fits in run.memory_gib after
    the weights, gradients, optimizer state and K/V cache, at most 4,096 tokens (larger
    passes are no faster there); on a GPU, what fits in half its memory after the weights,
    gradients and optimizer state, by the model's shape. None: no bound (micro_batch_size
    alone)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them (less memory, ~30%
    more compute); Hugging Face models' gradient_checkpointing_enable."""
    trim_microbatches: bool = True
    """On a CPU, give the allocator's free pages back to the OS before each micro-batch of an
    update (glibc's malloc_trim): its activations, of many sizes, otherwise leave holes that
    the next micro-batch's cannot reuse, and the update's peak climbs with every micro-batch
    (SmolLM2-135M in float32, an update of 16,640 tokens in 4,096-token micro-batches: 5.70
    GiB kept, 3.43 trimmed, in the same time). Costs the pages' faults again, once per
    micro-batch."""
    release_grads: bool = True
    """Free the gradients (with fp32 masters: their fp32 buffers) at the end of each update
    instead of keeping them until the next: 4 bytes a trained parameter given back during
    generation and evaluation (0.5 GiB for SmolLM2-135M), allocated again at the next update
    (an update's minibatches reuse them)."""
    dual_clip_c: float = Field(3.0, gt=1)
    """Dual-clip bound on negative-advantage tokens (loss 'dual_clip')."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus: loss -= entropy_coef * token entropy."""
    kl_estimator: TrainKlEstimatorName = "k3"
    """How the KL to the initial policy is estimated per token: k1, k2, k3 (Schulman's estimators;
    k3 is unbiased and non-negative) or 'package.module:function'."""
    kl_mode: Literal["loss", "reward"] = "loss"
    """KL to the initial policy as a loss term, or subtracted from the reward (summed over
    the response) before the advantages."""
    overlong_filter: bool = False
    """DAPO overlong filtering: truncated responses leave the loss. (DAPO's soft overlong
    punishment is a reward: the filter's `length` channel.)"""
    subsample: int | None = Field(None, ge=1)
    """BroRL: train k rollouts of each group, drawn uniformly; advantages from the whole
    group, each trained rollout weighing n/k and the rest counted in the loss's denominators,
    so the expected update is the whole group's. None: all."""
    mass_balance: bool = False
    """Report the responses' own-token probability before and after each update, correct and
    wrong, trained and left out (train/mass/*; one more forward pass a step)."""
    downsample: Literal["none", "d3s"] = "none"
    """d3s: train each group's max-advantage-variance subset of rollouts and, of their tokens,
    those with the largest |A| x entropy, on a schedule that relaxes to all (train.d3s.*);
    the rest leave the loss and its denominators."""
    d3s: D3SConfig = D3SConfig()
    correction: CorrectionConfig = CorrectionConfig()
    lr: float = Field(3e-4, gt=0)
    """AdamW's peak learning rate (after warmup_steps, decayed to lr * lr_end_factor)."""
    lr_end_factor: float = Field(0.1, ge=0, le=1)
    """Linear decay to lr * lr_end_factor over the run (a constant rate swings late pass@1)."""
    warmup_steps: int = Field(5, ge=0)
    """RL steps over which the learning rate ramps up linearly, (s + 1) / warmup_steps of the
    decayed rate at step s. AdamW's first step moves every weight by about lr whatever the
    gradient's size; a ramp lets the moment estimates settle first."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's decoupled weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """Gradients are clipped to this global norm before each optimizer step."""
    minibatches: int = Field(2, ge=1)
    """Optimizer steps per update: the step's batch split into this many minibatches (unless
    minibatch_groups is set)."""
    minibatch_groups: int | None = Field(None, ge=1)
    """Groups per optimizer step, as verl's ppo_mini_batch_size counts prompts: an update on
    n kept groups takes ceil(n / this) steps, so each group that carries a signal buys the same
    share of a step however it was found. None: train.minibatches steps per update."""
    epochs: int = Field(1, ge=1)
    """Passes over the step's batch per update (PPO epochs); above 1 the later passes are off-
    policy and the clip matters."""
    old_logprobs_from_engine: bool = True
    """The rows the trainer does not forward before its first optimizer step take the
    engine's behaviour log-probs as the old policy, saving a no-grad pass, when the engine is
    checked to be the trainer's policy: no TIS/MIS correction (train.correction.mode none),
    every trained token sampled at the trainer's version, and the first minibatch's rows
    (forwarded anyway) within old_logprobs_tolerance of their engine log-probs on every
    trained token. Otherwise the pass is taken. The check samples the rows, so an engine whose
    mismatch is sporadic rather than global wants a correction mode, or this off."""
    old_logprobs_tolerance: float = Field(1e-4, ge=0)
    """The largest gap (nats, per token) between the engine's and the trainer's log-probs at which
    old_logprobs_from_engine takes the engine's."""
    chosen_tokens: Literal["ratio", "mask"] = "ratio"
    """Tokens a tree chose rather than sampled (Sample.chosen: LATR's greedy and second-best
    tokens, ECHO's alternatives). 'ratio': trained as sampled tokens, their importance ratio
    taken against the log-probability of the distribution they were chosen from (what LATR
    and ECHO do; the gradient is then that of a sample that happened to draw them). 'mask':
    out of the loss (only sampled tokens train; a tree then shapes which prefixes are
    explored but never pushes up a token nobody sampled)."""
    pack_prompts: bool = True
    """Trainer forward passes hold each prompt once with its responses after it (a mask keeps
    them apart): the same log-probabilities up to float rounding, for fewer tokens. Checked
    against the padded pass on the first update; a model that disagrees is not packed."""
    packed_attention: Literal["auto", "segments", "mask"] = "auto"
    """How packed rows are attended. segments: each response with its prompt (and a tree
    child with its parent's prefix) gathered and run as batched SDPA calls of similar sizes,
    no (row x row) mask (rollwise.training.packed_attention); mask: SDPA over the whole row
    with a dense mask. auto: segments where the model attends by SDPA (measured on a CPU:
    1.19-1.45x a SmolLM2 pass, parity on the built-in model), else the mask. Checked against
    the padded pass on the first update; a model that disagrees falls back to the mask."""
    compile_blocks: bool = False
    """torch.compile each decoder block's norms and MLP (not its attention) with dynamic
    shapes, in place: one graph serves every micro-batch, the parameters keep their names.
    Measured on a 2-core Xeon, a SmolLM2 forward and backward pass: 1.11-1.12x, a few
    seconds of compile on the first update. Whole blocks are not offered: the packed layout
    the attention reads changes every micro-batch, and each change recompiles."""
    chunked_logits: bool = True
    """Log-probabilities and entropies from the last hidden state, a chunk of tokens at a time
    with the LM head inside the chunk, at the response tokens only: the (tokens x vocabulary)
    logits never exist whole, in the forward or the backward pass (they set the update's peak
    memory otherwise). The same values up to float rounding; checked against the full logits
    on the first update. Off by itself for a model whose head is not a plain Linear or whose
    config transforms the logits after it (soft-capping, scaling)."""
    logit_chunk_tokens: int | None = Field(None, gt=0)
    """Tokens per chunk of train.chunked_logits; None: 24 MiB of fp32 logits per chunk on a
    CPU (128 tokens of SmolLM2's 49k vocabulary, 41 of Qwen2.5's 152k), 256 MiB on a GPU."""
    loss_denominator: Literal["kept", "generated"] = "kept"
    """What the loss is divided by. 'kept': the sequences (or tokens, per loss_agg) trained on,
    so each weighs more as fewer groups carry a signal. 'generated': every sequence the step
    generated, the groups Filter dropped (all advantages 0) included, as TRL's GRPOTrainer and
    verl without dynamic sampling normalise over the whole generation batch (the loss shrinks as
    groups saturate). Under AdamW both learn the same per step (BENCHMARKS.md, "End to
    end against TRL, tiny model")."""
    skip_zero_advantage: bool = True
    """Run no forward or backward pass for samples whose every token has advantage 0 (all
    of a group with equal rewards, under GRPO): with ppo_clip, dual_clip or gspo, no entropy
    bonus and no KL loss term their gradient is exactly 0. They still count in the loss
    aggregation's denominators, so the update is the same up to float rounding."""
    clip_low: float = Field(0.2, ge=0)
    """PPO clip below: the ratio is clipped at 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0)
    """PPO clip above: the ratio is clipped at 1 + clip_high (DAPO's clip-higher sets it above
    clip_low)."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL estimate to the initial policy; 0 keeps no reference model. With
    LoRA the reference is the model with its adapters disabled: no second copy."""
    lora: LoraConfig = LoraConfig()

    @model_validator(mode="after")
    def _lora_unsharded(self):
        if self.lora.rank and self.world_size > 1:
            raise ValueError("train.lora with train.world_size > 1: FSDP2 sharding of a peft "
                             "model is not supported; LoRA's trainable state is small, so use "
                             "train.world_size=1 (or train.lora.rank=0 to shard full training)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _moved_overlong(cls, data):
        moved = [k for k in ("overlong_buffer", "overlong_max_length", "overlong_penalty_factor")
                 if isinstance(data, dict) and k in data]
        if moved:
            raise ValueError(f"train.{moved[0]} has moved: DAPO's soft overlong penalty is the "
                             "filter's length channel. Use filter.reward={exact: 1, length: F} "
                             "with filter.length_max (L_max) and filter.length_buffer (L_cache)")
        return data


class SFTConfig(Section):
    steps: int = Field(2000, ge=0)
    """Supervised warm-start steps on the task's worked solutions (0: none); the result is cached
    under run.root/.cache."""
    batch_size: int = Field(64, gt=0)
    """Worked solutions per warm-start step."""
    lr: float = Field(1e-3, gt=0)
    """The warm start's AdamW learning rate."""
    noise: Share | dict[str, Share] = 0.6
    """Share of worked solutions whose top answer digit is off by one, so RL has work to do;
    or a share per tier ({sub2: 0.6}: the other tiers are learned from clean solutions)."""
    eval_every: int = Field(100, gt=0)
    """Warm-start steps between its progress lines (loss)."""
    from_path: bool = False
    """Warm-start the model at model.path too (a chat model learning a task's worked format,
    configs/smollm2-long.yaml), cached like the built-in model's; False: RL starts from
    model.path as it is. Its weights and AdamW stay float32, its products run in model.dtype
    (autocast), each batch is cut into micro-batches of similar lengths, its loss comes
    through the trainer's chunked head (no full-vocabulary logits), and train's
    gradient_checkpointing and trim_microbatches apply to it."""
    microbatch_tokens: int = Field(4096, gt=0)
    """With from_path: padded tokens per forward pass (bounds the logits' memory)."""

    @model_validator(mode="after")
    def _pretrained_lr(self):
        if self.from_path and "lr" not in self.model_fields_set:
            raise ValueError("sft.from_path tunes a pretrained model: set sft.lr for it (e.g. "
                             "5e-5); the default 1e-3 is the built-in model's from scratch")
        return self


class SyncConfig(Section):
    mode: Literal["full", "sparse"] = "full"
    """'full' ships every tensor; 'sparse' ships only the elements whose stored value changed
    since the engine's version (SparseRL-Sync), exactly. See rollwise/sync/."""
    coding: Literal["delta", "context", "pairs"] = "context"
    """How a sparse payload stores its changes, exactly either way. 'context' (the smallest
    at every lr measured: on SmolLM2's real RL steps 348x fewer bytes than full at lr 1e-6,
    120x at 1e-5, against delta's 161x and 50x): index gaps and the difference of each
    value's bits from the engine's, Rice-coded per group of elements that share the engine's
    exponent (whether an element changes depends mostly on it), ~0.5 bytes per bf16 change at
    lr 1e-6, a codec about twice delta's time; 'delta': the same gaps (a byte each) and
    differences (2 bits for the +-1 of a low-lr step), ~1.3 bytes per bf16 change;
    'pairs': SparseRL-Sync's (int32 index, value) pairs, 6 bytes per bf16 change, fixed-size
    for one collective per bucket."""
    transport: Literal["inproc", "process", "socket"] = "inproc"
    """'inproc': the engine lives in the trainer's process; 'process': in a child process on
    this machine, fed through shared memory; 'socket': in a child process, fed through a Unix
    socket (every byte copied, as over a network; no /dev/shm needed)."""
    engine_dtype: Literal["same", "float32", "bfloat16", "float16"] = "same"
    """The engine's weight dtype; 'same' keeps the trainer's. bfloat16 with float32 trainer
    weights is the usual GPU setup (fp32 master weights, bf16 inference weights)."""
    checksum: bool = True
    """Each payload carries a CRC-32 per tensor of the result; the engine verifies it (one pass
    over its weights) and refuses to go on when it differs."""
    check: bool = False
    """Also compare the engine's weights with the trainer's bit for bit after every sync
    (debugging; reads every weight back from the engine)."""
    bucket_mb: float = Field(512, gt=0)
    """Largest payload bucket (one collective per bucket on a GPU transport)."""


class LoopConfig(Section):
    """How generation and training share time (rollwise/loop/)."""
    mode: Literal["sync", "async"] = "sync"
    """'sync': generate, then train, then sync, one step after another (on-policy). 'async':
    a producer thread generates later steps while the trainer updates; new weights reach the
    engine between its decode steps, so a rollout may span versions (each token keeps its
    own). At max_staleness = 0 it is the synchronous loop, bit for bit."""
    max_staleness: int = Field(1, ge=0)
    """async: the most policy versions a trained token may lag the policy it updates. Enforced
    by admission: step k's generation starts only once the trainer holds version
    k - 1 - max_staleness, so nothing is generated only to be dropped."""
    carried_kv: Literal["auto", "keep", "recompute"] = "auto"
    """What a sequence living across a weight sync does with the K/V the old weights computed:
    APRIL's carried answers (paused between steps) and the async loop's requests in flight.
    'keep': it continues from that K/V (no prefill again; its later tokens are sampled on a
    context the old weights encoded, each keeping its version and behaviour log-probability
    as sampled). 'recompute': prompt + response are prefilled again under the new weights.
    'auto': recompute for carried answers, keep in flight (the built-in engine's weights are
    written between two decode steps). keep needs the built-in engine (not loop.backend=ray
    or engine.backend=vllm); kept answers hold K/V through the update, so run.memory_gib
    then splits the budget between the cache and the update."""
    backend: Literal["local", "ray"] = "local"
    """'local': the engine in this process (or a child, sync.transport); 'ray': Ray actors
    with a built-in engine each (rollwise/engine/ray_pool.py), dead ones replaced, their
    requests re-queued."""
    rollout_workers: int = Field(2, ge=1)
    """ray: rollout workers (Ray actors) in the pool."""
    ray_address: str | None = None
    """ray: a running cluster's address; None starts Ray on this machine."""
    wait_timeout_s: float = Field(1800.0, gt=0)
    """async: the longest the trainer waits for a step's rollouts, or the producer for new
    weights or an idle point, before the run stops with an error naming what it waited for."""


class SearchConfig(Section):
    """Test-time search under a budget of run.eval_samples rollouts per prompt (`rollwise eval
    --search`; docs/methods.md#dora)."""
    allocation: Literal["dora", "solution"] = "dora"
    """How the budget left after the first candidates is spread: dora (by direction quality,
    each direction's weight the mean of its candidates') or solution (by candidate, so a
    direction drawn more often gets more)."""
    directions: int = Field(4, ge=1)
    """Candidates sampled first, to the end; their openings are the search's directions."""
    prefix_tokens: int = Field(8, ge=1)
    """A candidate's direction: its first this many response tokens."""
    temperature: float = Field(0.2, gt=0)
    """Softmax temperature over the candidates' mean token log-probabilities."""


class RunConfig(Section):
    name: str = "default"
    """The run's name: it writes run.root/run.name (an earlier run of the name is replaced, unless
    resumed)."""
    root: str = "runs"
    """The folder runs are written under (and the warm-start cache, root/.cache)."""
    seed: int = 0
    """Seeds sampling, prompt order and initialisation: a run is bit-reproducible on one machine
    for a seed."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer and the built-in engine run: auto takes cuda when one is visible.
    (vLLM places itself on the GPU when it has one.)"""
    eval_every: int = Field(10, gt=0)
    """RL steps between held-out evaluations (also at step 0 and at the last step)."""
    eval_samples: int = Field(1, ge=1)
    """Held-out pass@1 from this many samples per prompt at eval_temperature (1 at 0: greedy)."""
    eval_temperature: float = Field(0.0, ge=0)
    """0: greedy. RL maximizes the reward sampled at generate.temperature, so the mean over
    samples at that temperature is the pass@1 the policy is trained for."""
    eval_scoring_deadline_s: float = Field(300.0, gt=0)
    """An evaluation's scoring, as a whole, ends by then: answers not scored yet count as
    failed (eval/failed/deadline) and the run goes on. Each answer also has filter.timeout_s."""
    log: Literal["auto", "rich", "plain", "quiet"] = "auto"
    """Progress display: rich (a live bar, on a terminal), plain (a line per step, for logs and
    CI), quiet, or auto (rich on a terminal outside CI, else plain)."""
    init: str | None = None
    """Start RL from this model folder instead of the (cached) warm start."""
    threads: int = Field(0, ge=0)
    """torch CPU threads; 0 keeps torch's default."""
    memory_gib: Annotated[float, Field(gt=0)] | Literal["auto"] = "auto"
    """A CPU run's memory budget (GiB of resident memory): the built-in engine's K/V cache
    (and so an evaluation's batch) and the update's micro-batch tokens are sized within it,
    after the weights, gradients and optimizer state; a budget that cannot hold them is
    refused before any work. auto: 3/4 of the memory available at the start. Either way the
    sizes stay at what pays (a step's sequences; 4,096-token micro-batches)."""
    trim_memory: bool = True
    """Between phases of the synchronous loop, give back what the last one freed: the
    built-in engine's K/V cache during the update (on a CPU), and the allocator's free pages
    after generation, the update and each evaluation (glibc's malloc_trim). Lowers the run's
    peak resident memory; false keeps them for reuse."""
    tensorboard: bool = True
    """Also write TensorBoard event files to <run>/tensorboard when tensorboard is installed."""
    wandb: bool = False
    """Also log to Weights & Biases (needs `pip install wandb`; WANDB_MODE=offline works)."""
    wandb_project: str = "rollwise"
    """The Weights & Biases project, with run.wandb."""
    sinks: list[str] = []
    """Extra metric sinks by import path, 'package.module:factory'; factory(run_dir, cfg)
    returns an object with write(step, metrics) and close() (rollwise.report.sinks)."""
    report: bool = True
    """Write <run>/report.html (plots of the run) at the end of the run."""
    checkpoint_every: int = Field(10, ge=0)
    """Checkpoint every N steps (and at the end, and on Ctrl-C after the step finishes);
    0: only at the end and on Ctrl-C. `rollwise train --resume RUN` continues from the last."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept (the newest)."""
    search: SearchConfig = SearchConfig()

    @model_validator(mode="after")
    def _check_eval_sampling(self):
        if self.eval_samples > 1 and self.eval_temperature == 0:
            raise ValueError(f"run.eval_samples = {self.eval_samples} at run.eval_temperature "
                             "= 0 repeats the greedy answer: set run.eval_temperature > 0 "
                             "(e.g. generate.temperature) or run.eval_samples = 1")
        return self


class Config(Section):
    model: ModelConfig = ModelConfig()
    """The policy model: a Hugging Face folder or catalog name (model.path), or the built-in tiny
    model."""
    task: TaskConfig = TaskConfig()
    """The problems: a built-in task, reasoning-gym datasets, or a dataset file, and how prompts
    are rendered."""
    engine: EngineConfig = EngineConfig()
    """The rollout engine: rollwise's built-in engine, vLLM or a plugin, and its batch and cache
    sizes."""
    generate: GenerateConfig = GenerateConfig()
    """Generate: how trajectories are proposed (groups, trees, agent episodes) and sampled."""
    filter: FilterConfig = FilterConfig()
    """Filter: the reward (verifiers and their weights), scored in worker processes with time
    limits."""
    control: ControlConfig = ControlConfig()
    """Control: which prompts each step draws, how many rollouts each gets, and in-flight
    controllers."""
    replay: ReplayConfig = ReplayConfig()
    """Replay: groups reused from a buffer of recent ones instead of generated again."""
    train: TrainConfig = TrainConfig()
    """The update: advantages, policy loss, optimizer and the trainer's memory levers."""
    sft: SFTConfig = SFTConfig()
    """The supervised warm start on worked solutions, before RL."""
    sync: SyncConfig = SyncConfig()
    """Weight sync from the trainer to the engine after each update."""
    loop: LoopConfig = LoopConfig()
    """The loop: synchronous or asynchronous with bounded staleness, local or on Ray."""
    run: RunConfig = RunConfig()
    """The run: its name and folder, seed, device, evaluations, logging, checkpoints."""

    @model_validator(mode="after")
    def _check_gym_task(self):
        """A gym task's datasets, settings and verifier, against reasoning-gym: here, so a
        mistake is said before anything imports torch (model.dtype=auto below may)."""
        from rollwise.gym_settings import precheck
        precheck(self.task.name, self.task.gym, self.filter.reward)
        return self

    @model_validator(mode="after")
    def _check_single_rollout_baseline(self):
        if self.train.advantage == "mssr" and self.control.baseline == "none":
            raise ValueError("train.advantage = mssr subtracts a baseline that needs no group: "
                             "set control.baseline = running (or v0)")
        return self

    @model_validator(mode="after")
    def _check_nudge(self):
        n = self.generate.nudge
        if self.generate.strategy == "nudge" and not (n.contexts or n.contexts_file):
            raise ValueError("generate.strategy = nudge conditions rollouts on strategy "
                             "contexts: give generate.nudge.contexts (a list of short hints) "
                             "or generate.nudge.contexts_file (one per line)")
        if self.train.nudge.distill_coef > 0 and self.generate.strategy == "nudge" and (
                self.train.downsample != "none" or self.train.subsample):
            raise ValueError("train.nudge.distill_coef > 0 adds distillation rows that "
                             "train.downsample and train.subsample would count as group "
                             "members: set train.nudge.distill_coef = 0, or turn those off")
        return self

    @model_validator(mode="after")
    def _check_carried_kv(self):
        where = ("loop.backend=ray" if self.loop.backend == "ray" else
                 "engine.backend=vllm" if self.engine.backend == "vllm" else None)
        if where and self.loop.carried_kv == "keep":
            raise ValueError(f"loop.carried_kv = keep holds paused sequences' K/V in the "
                             f"built-in engine; {where} prefills them again: set "
                             f"loop.carried_kv = recompute (or auto)")
        if where and self.loop.carried_kv == "recompute" and self.loop.mode == "async":
            raise ValueError(f"loop.carried_kv = recompute in the async loop prefills the "
                             f"requests in flight again after each weight push, which only "
                             f"the built-in engine does; {where}: set loop.carried_kv = auto")
        return self

    def keeps_carried_kv(self) -> bool:
        """Paused answers keep their K/V in the engine between rounds (APRIL's carry)."""
        return self.loop.carried_kv == "keep"

    def recomputes_in_flight(self) -> bool:
        """The async loop prefills its requests in flight again after each weight push."""
        return self.loop.mode == "async" and self.loop.carried_kv == "recompute"

    @model_validator(mode="after")
    def _resolve_auto_dtype(self):
        if self.model.dtype == "auto":
            from rollwise.devices import native_bf16  # torch: only when asked for
            self.model.dtype = "bfloat16" if native_bf16(self.run.device) else "float32"
        return self


def _allowed_keys(loc: tuple) -> list[str]:
    model: Any = Config
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not isinstance(field.annotation, type) or not issubclass(
                field.annotation, BaseModel):
            break
        model = field.annotation
    return list(model.model_fields)


def _sectioned(name: str) -> list[str]:
    """Every 'section.name' (to any depth) a bare key `name` could mean, e.g. steps ->
    train.steps, sft.steps."""
    found, todo = [], [("", Config)]
    while todo:
        prefix, model = todo.pop(0)
        for key, field in model.model_fields.items():
            if key == name and prefix:
                found.append(f"{prefix}{key}")
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                todo.append((f"{prefix}{key}.", field.annotation))
    return found


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(e["loc"][:-1])
            guess = difflib.get_close_matches(str(e["loc"][-1]), allowed, n=1)
            sectioned = _sectioned(str(e["loc"][-1])) if len(e["loc"]) == 1 else []
            hint = (f" Keys sit in sections: did you mean {' or '.join(sectioned)}?" if sectioned
                    else f" Did you mean '{guess[0]}'?" if guess else "")
            lines.append(f"unknown key '{where}'.{hint} Allowed here: {', '.join(allowed)}")
        elif isinstance(e.get("input"), dict):  # a section-level check names its own keys
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {msg}" if where else msg)
        else:
            msg = e["msg"].removeprefix("Value error, ")
            # a check that names its key and value itself is said as it is
            lines.append(msg if msg.startswith(f"{where} ") else
                         f"{where} = {e.get('input')!r}: {msg}")
    return "invalid config:\n  " + "\n  ".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r}: empty key part")
    if not raw.strip():
        return parts, None
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:  # not YAML ('{prompt} Answer in \\boxed{}.'): the text itself
        return parts, raw
    # a text field keeps its text where YAML would read it as something else ('{prompt}')
    keep_text = value is not None and not isinstance(value, str) and _takes_text(parts)
    return parts, raw if keep_text else value


def _takes_text(parts: list[str]) -> bool:
    """Whether the config field at `parts` takes text only (str, or str | None)."""
    node: Any = Config
    for part in parts:
        field = getattr(node, "model_fields", {}).get(part)
        if field is None:
            return False
        node = field.annotation
    return node is str or set(typing.get_args(node)) == {str, type(None)}


def load_config(path: str | Path | None = None, overrides: list[str] = (),
                check_files: bool = True) -> Config:
    """The validated config a command line would run.

    Args:
        path: a preset's name (`"smollm2"`; `rollwise configs list`), a YAML file of
            sections, or None for the built-in defaults.
        overrides: `section.key=value` texts applied on top, values read as YAML
            (`["train.lr=1e-4", "run.name=try1"]`).
        check_files: check that the files the config names exist (model.path, run.init,
            task.path, ...), before validation; False for a config only to be read.

    Raises:
        ConfigError: an unknown key (with the keys allowed there, and for a bare key its
            sectioned names), a bad value, or a path that does not exist, before any work.
    """
    data: dict = {}
    if path is not None:
        path = presets.resolve(path)  # a path, or a preset's name
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for p in parts[:-1]:
            if node.get(p) is None:  # a YAML key with no value (`chain_sum:`) is an empty one
                node[p] = {}
            node = node[p]
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: '{p}' is not a section")
        node[parts[-1]] = value
    if check_files:  # before validation, which may import reasoning-gym or torch
        check_paths(data)
    return validate(data)


def validate(data: dict) -> Config:
    """A Config from plain data ({section: {key: value}}), or a ConfigError naming each bad
    field, its value and what is allowed."""
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


DEFAULTS_HEADER = """\
# The default embedded CPU run: every key rollwise reads, at its default, with what it does.
# Generated from rollwise/config.py by
#   python3 -m rollwise config defaults > configs/default.yaml
# and tests/test_config.py fails when the two drift apart.
"""


def defaults_yaml() -> str:
    """configs/default.yaml: every key at its default."""
    return DEFAULTS_HEADER + commented_yaml(Config())


def commented_yaml(cfg: Config) -> str:
    """Every key of `cfg` with its value, each under its description as a comment; it loads
    back to the same config."""
    return "".join(_section_lines(cfg, 0))


def _section_lines(section: BaseModel, indent: int):
    pad = " " * indent
    for name, field in type(section).model_fields.items():
        value = getattr(section, name)
        about = field.description or (type(value).__doc__ if isinstance(value, Section) else "")
        for line in textwrap.wrap(" ".join((about or "").split()), width=96 - indent,
                                  break_on_hyphens=False):
            yield f"{pad}# {line}\n"
        if isinstance(value, BaseModel):
            yield f"{pad}{name}:\n"
            yield from _section_lines(value, indent + 2)
        else:
            flow = yaml.safe_dump([value], default_flow_style=True, width=10**6)
            yield f"{pad}{name}: {flow.strip()[1:-1]}\n"

