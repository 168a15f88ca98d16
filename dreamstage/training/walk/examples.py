"""Examples into training windows (windows.py: a window's tokens and its loss mask).

What is a target:
- text: every token, except a window's first token and the overlap tokens the
  previous window already trained. Text is tokenized with the model's own
  add_special (BOS if the model adds one) and without parsing special tokens;
  no EOS is appended (text is a continuation, not a finished turn).
- prompt/completion: the completion tokens and one EOS after them (the model
  learns to stop, as a completion endpoint would). Prompt and completion are
  tokenized separately, the way the server sees a prompt and then generates.
- chat: assistant turns with `train` not false: their content and the
  end-of-turn token (the first end-of-generation token the template emits after
  the content). The role header, the newline after end-of-turn, and every
  system, user and tool token are context. Rendering goes through the model's
  own chat template (Jinja2, with `tools`), segment by segment, so the header
  and the reply tokenize exactly as at inference: the prompt rendered with
  add_generation_prompt, then the generated tokens.

Fit, for examples longer than the window (chat and prompt/completion):
- `left`: the last `window` tokens ending at the reply's end-of-turn.
- `middle`: keep the head (the system message with the template's preamble, or
  just BOS) and the whole reply unit (header + reply), fill the rest with the
  most recent history before the reply; if head plus reply do not fit, the
  example is refused (raise the window or use fit=left).
A conversation with several trained replies becomes as few windows as fit:
the window ending at the last untrained reply trains every untrained reply
wholly inside it; repeat for the latest reply still untrained. So each
assistant token is trained exactly once whenever its turn fits the window.
Messages after the last trained reply carry no loss and are dropped.
"""
from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from dreamstage.serving.chat import FALLBACK_TEMPLATE, chat_formatter, reads_tools
from dreamstage.serving.tools import prompt_messages
from dreamstage.training.jobs.example_forms import ChatExample, Message, PromptCompletion, TextExample, TokenExample
from dreamstage.training.jobs.spec import JobSpec, SourcedExample
from dreamstage.training.walk.groups import TrainGroup, assemble_group, group_by_prefix
from dreamstage.training.walk.windows import TrainWindow


class Tokenizer(Protocol):
    """What rendering needs from a model; `ResidentModel` satisfies it."""

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]: ...
    def detokenize(self, tokens: list[int], special: bool = False) -> str: ...
    def chat_template(self) -> str | None: ...
    def is_eog(self, token: int) -> bool: ...
    @property
    def bos(self) -> int: ...
    @property
    def eos(self) -> int: ...


class ExampleError(ValueError):
    """An example that cannot become a window. `loc` follows pydantic's style
    (("examples", 3, "completions", 1)) so the server can answer 422 with it."""

    def __init__(self, loc: tuple, message: str):
        self.loc = loc
        self.message = message
        super().__init__(f"{_loc_text(loc)}: {message}")


class ExampleErrors(ValueError):
    """Every example that failed to render, in body order."""

    def __init__(self, errors: list[ExampleError]):
        self.errors = errors
        super().__init__("; ".join(str(e) for e in errors))


def _loc_text(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _label_loc(label: str) -> tuple:
    """ "examples[3].completions[1]" -> ("examples", 3, "completions", 1)."""
    loc: list = []
    for piece in label.split("."):
        name, _, rest = piece.partition("[")
        loc.append(name)
        for idx in rest.rstrip("]").split("]["):
            if idx:
                loc.append(int(idx))
    return tuple(loc)


# -- rendering: one example into a token sequence with trained spans ----------
@dataclass(frozen=True)
class ReplySpan:
    unit_start: int   # first token of the reply's unit (its role header)
    start: int        # first trained token
    end: int          # one past the last trained token


@dataclass
class Rendered:
    """A whole example as tokens, per-token roles, and its trained spans.

    roles[t] is "reply" for a trained token (assistant content + end-of-turn,
    or completion + EOS), the message role for context tokens, "template" for
    headers and separators the template adds, "prompt" for a raw prompt.
    """

    tokens: list[int]
    roles: list[str]
    replies: list[ReplySpan]
    head: int = 0     # tokens [0, head) are pinned by fit=middle
    source: int = 0
    label: str = ""
    loc: tuple = field(default_factory=tuple)


def render_prompt_completion(ex: PromptCompletion, tok: Tokenizer) -> Rendered:
    prompt = tok.tokenize(ex.prompt, True, False)
    completion = tok.tokenize(ex.completion, False, False)
    if tok.eos >= 0:
        completion.append(tok.eos)
    tokens = prompt + completion
    head = 1 if prompt and prompt[0] == tok.bos else 0
    roles = ["prompt"] * len(prompt) + ["reply"] * len(completion)
    return Rendered(tokens, roles, [ReplySpan(len(prompt), len(prompt), len(tokens))], head)


def render_tokens(ex: TokenExample, tok: Tokenizer) -> Rendered:
    """A served prompt's exact tokens (context) and a reply's tokens (trained), as given."""
    tokens = [*ex.prompt, *ex.reply]
    head = 1 if ex.prompt[0] == tok.bos else 0
    roles = ["prompt"] * len(ex.prompt) + ["reply"] * len(ex.reply)
    return Rendered(tokens, roles, [ReplySpan(len(ex.prompt), len(ex.prompt), len(tokens))], head)


class TemplateError(ValueError):
    pass


class ChatRenderer:
    """Renders chats through a model's Jinja2 chat template, message by message.

    It uses llama-cpp-python's Jinja2ChatFormatter, the formatter serving uses
    (dreamstage/serving/chat.py, chat_formatter), so a trained conversation renders exactly as the same
    conversation would be prompted: same environment, filters and globals.
    """

    def __init__(self, tok: Tokenizer, template: str | None = None):
        self.tok = tok
        source = self.source = template if template is not None else (tok.chat_template() or FALLBACK_TEMPLATE)
        bos_text = tok.detokenize([tok.bos], special=True) if tok.bos >= 0 else ""
        eos_text = tok.detokenize([tok.eos], special=True) if tok.eos >= 0 else ""
        try:
            self._formatters = {gen: chat_formatter(source, bos_text, eos_text, gen) for gen in (False, True)}
        except Exception as e:  # a template that does not compile
            raise TemplateError(f"the chat template does not compile: {e}") from e

    def _render(self, messages: list[dict], tools, gen: bool) -> str:
        try:
            # our message dicts have the shape of llama_cpp's TypedDicts, which a list[dict] cannot say
            return self._formatters[gen](messages=cast("list[Any]", messages), tools=tools).prompt
        except Exception as e:  # raise_exception() and any Jinja error alike
            raise TemplateError(f"the chat template refused these messages: {e}") from e

    def user_turn(self, content: str) -> tuple[list[int], list[int]]:
        """`content` as a conversation's lone user turn: (the template's tokens
        before it, the content's own tokens), tokenized as render() tokenizes a
        message (the content parses no control tokens)."""
        text = self._render([Message(role="user", content=content).template_dict()], None, False)
        at = text.rfind(content) if content else -1
        if at < 0:
            raise TemplateError("the chat template does not render a user turn's content as it is written")
        head = self.tok.tokenize(text[:at], True, True)
        if len(head) >= 2 and head[0] == head[1] == self.tok.bos:
            head = head[1:]   # template already emitted BOS and the tokenizer added one
        return head, self.tok.tokenize(content, False, False)

    def render(self, ex: ChatExample) -> Rendered:
        msgs = ex.messages
        # Nothing after the last trained reply carries loss; drop it.
        last = max(i for i, m in enumerate(msgs) if m.trained)
        msgs = msgs[: last + 1]
        # Tools and calls as serving prompts them (dreamstage/serving/tools.py): through a
        # template that reads tools, else a system message first and calls as tagged text.
        native = bool(ex.tools) and reads_tools(self.source)
        dicts = prompt_messages([m.template_dict() for m in msgs], list(ex.tools or []), native)
        tools = ex.tools if native else None
        lead = len(dicts) - len(msgs)                  # a system message put first for the tools
        trained = [False] * lead + [m.trained for m in msgs]
        role_of = ["system"] * lead + [m.role for m in msgs]
        full = self._render(dicts, tools, False)

        # Character cuts: the end of every message, and for each trained reply
        # the end of its header (the prompt with add_generation_prompt).
        cuts: list[tuple[int, str, int]] = []  # (offset, what ends here, message index)
        for i in range(len(dicts)):
            if trained[i]:
                header = self._render(dicts[:i], tools, True)
                self._check_prefix(full, header, f"messages[:{i - lead}] with add_generation_prompt", i - lead)
                cuts.append((len(header), "header", i))
            upto = self._render(dicts[: i + 1], tools, False)
            self._check_prefix(full, upto, f"messages[:{i - lead + 1}]", i - lead)
            cuts.append((len(upto), "message", i))
        cuts.sort(key=lambda c: (c[0], c[2], c[1] == "message"))

        tokens: list[int] = []
        roles: list[str] = []
        replies: list[ReplySpan] = []
        head = 0
        pos = 0
        unit_start = 0
        for offset, what, i in cuts:
            if offset < pos:
                raise TemplateError(f"the chat template renders messages[{i}] out of order")
            content = dicts[i].get("content") if what == "message" else None
            piece = self._tokenize_piece(full[pos:offset], content if isinstance(content, str) else None,
                                         not tokens)
            if not tokens and len(piece) >= 2 and piece[0] == piece[1] == self.tok.bos:
                piece = piece[1:]  # template already emitted BOS and the tokenizer added one
            role = role_of[i]
            if what == "header":
                roles += ["template"] * len(piece)
                unit_start = len(tokens)
                tokens += piece
            elif trained[i]:
                start = len(tokens)
                n_trained = next((k + 1 for k, t in enumerate(piece) if self.tok.is_eog(t)), len(piece))
                tokens += piece
                roles += ["reply"] * n_trained + ["template"] * (len(piece) - n_trained)
                replies.append(ReplySpan(unit_start, start, start + n_trained))
            else:
                tokens += piece
                roles += [role] * len(piece)
                if i == 0 and role == "system":
                    head = len(tokens)
            if what == "message":
                unit_start = len(tokens)
            pos = offset
        if head == 0 and tokens and tokens[0] == self.tok.bos:
            head = 1
        # Drop what follows the last reply's end-of-turn (e.g. a newline).
        end = replies[-1].end
        return Rendered(tokens[:end], roles[:end], replies, head)

    def _tokenize_piece(self, text: str, content: str | None, add_special: bool) -> list[int]:
        """The template's text parses control tokens; the message's own content
        does not, as in serving (server/prompts.py): a `<|im_end|>` written in an
        example stays text, and llama.cpp's special-token pass (quadratic in its
        matches) never runs over user text. The content is the last occurrence in
        its piece: only the template's end-of-turn text follows it."""
        at = text.rfind(content) if content else -1
        if content is None or at < 0:
            return self.tok.tokenize(text, add_special, True)
        out: list[int] = []
        for part, special in ((text[:at], True), (content, False), (text[at + len(content):], True)):
            if part:
                out += self.tok.tokenize(part, add_special and not out, special)
        return out

    @staticmethod
    def _check_prefix(full: str, part: str, what: str, i: int) -> None:
        if not full.startswith(part):
            raise TemplateError(
                f"the chat template does not render {what} as a prefix of the whole conversation "
                f"(it rewrites earlier turns), so messages[{i}] cannot be located"
            )


# -- fit: a rendered example into windows -------------------------------------
def fit_windows(r: Rendered, window: int, fit: str) -> list[TrainWindow]:
    """Windows of at most `window` tokens training every reply once (see module doc)."""
    if fit not in ("middle", "left"):
        raise ValueError(f"fit {fit!r} is not one of middle, left")
    pending = list(range(len(r.replies)))
    out: list[TrainWindow] = []
    while pending:
        target = r.replies[pending[-1]]
        if fit == "left":
            ranges = [(max(0, target.end - window), target.end)]
        else:
            head = min(r.head, target.unit_start)
            need = head + target.end - target.unit_start
            if need > window:
                raise ExampleError(r.loc, f"the {'system message and ' if head > 1 else ''}reply need {need} tokens, "
                                          f"more than window {window} (fit=middle); raise window or use fit=left")
            hist = max(head, target.unit_start - (window - need))
            ranges = [(0, head), (hist, target.end)] if head else [(hist, target.end)]
        index = [i for a, b in ranges for i in range(a, b)]
        where = {i: p for p, i in enumerate(index)}
        mask = [0] * len(index)
        still: list[int] = []
        for k in pending:
            span = r.replies[k]
            inside = all(i in where for i in range(span.start, span.end)) and where.get(span.start, 0) >= 1
            if k == pending[-1] or inside:
                for i in range(span.start, span.end):
                    if where.get(i, 0) >= 1:
                        mask[where[i]] = 1
            else:
                still.append(k)
        pending = still
        if any(mask):
            out.append(TrainWindow(tuple(r.tokens[i] for i in index), tuple(mask), r.source, r.label))
    out.reverse()  # conversation order
    if not out:
        raise ExampleError(r.loc, "nothing to train: no target token has a predecessor in its window")
    return out


def text_windows(tokens: Sequence[int], window: int, overlap: int, source: int = 0,
                 label: str = "") -> list[TrainWindow]:
    """Split a long text into windows that overlap by `overlap` tokens.

    Window k+1 starts `overlap` tokens before window k ends; the overlap is
    context only, so every token after the first is a target exactly once.
    """
    if not 1 <= overlap <= window // 2:
        raise ValueError(f"overlap {overlap} must be in 1..{window // 2} for window {window}")
    n = len(tokens)
    out: list[TrainWindow] = []
    start = 0
    while n >= 2:
        end = min(start + window, n)
        first_target = 1 if start == 0 else overlap
        mask = tuple(0 if t < first_target else 1 for t in range(end - start))
        out.append(TrainWindow(tuple(tokens[start:end]), mask, source, label))
        if end == n:
            break
        start = end - overlap
    return out


# -- a whole job --------------------------------------------------------------
@dataclass(frozen=True)
class RenderedJob:
    train: tuple[TrainWindow | TrainGroup, ...]   # a group of completions is one TrainGroup
    held_out: tuple[TrainWindow, ...]


def render_example(sx: SourcedExample, tok: Tokenizer, window: int, overlap: int, fit: str,
                   chat: ChatRenderer | None = None) -> list[TrainWindow]:
    loc = _label_loc(sx.label)
    ex = sx.example
    try:
        if isinstance(ex, TextExample):
            wins = text_windows(tok.tokenize(ex.text, True, False), window, overlap, sx.source, sx.label)
            if not wins:
                raise ExampleError(loc, "text has fewer than 2 tokens; nothing to train")
            return wins
        if isinstance(ex, PromptCompletion):
            r = render_prompt_completion(ex, tok)
        elif isinstance(ex, ChatExample):
            r = (chat or ChatRenderer(tok)).render(ex)
        elif isinstance(ex, TokenExample):
            r = render_tokens(ex, tok)
        else:  # pragma: no cover - the spec flattens groups
            raise ExampleError(loc, f"cannot render {type(ex).__name__}")
        r.source, r.label, r.loc = sx.source, sx.label, loc
        return fit_windows(r, window, fit)
    except TemplateError as e:
        raise ExampleError(loc, str(e)) from e


def render_job(spec: JobSpec, tok: Tokenizer) -> RenderedJob:
    """All windows of a job, split into train and held-out (by source example).

    Raises ExampleErrors listing every example that cannot be rendered, so the
    server can refuse the body (422) before the job is accepted.
    """
    chat = ChatRenderer(tok) if any(isinstance(s.example, ChatExample) for s in spec.examples) else None
    held = held_out_sources([s.source for s in spec.examples], spec.val_split, spec.seed)
    train: list = []                 # TrainWindow, or a group's label until its members are in
    held_out: list[TrainWindow] = []
    members: dict[str, list[tuple[SourcedExample, list[TrainWindow]]]] = {}
    errors: list[ExampleError] = []
    for sx in spec.examples:
        try:
            wins = render_example(sx, tok, spec.window, spec.overlap, spec.fit, chat)
        except ExampleError as e:
            errors.append(e)
            continue
        if sx.source in held:
            held_out.extend(wins)    # held-out loss is measured per window, unweighted
        elif sx.group is not None:
            if sx.group not in members:
                members[sx.group] = []
                train.append(sx.group)
            members[sx.group].append((sx, wins))
        else:
            train.extend(wins)
    if errors:
        raise ExampleErrors(errors)
    for i, item in enumerate(train):
        if isinstance(item, str):
            # a completion is one trained reply, so it renders to exactly one window
            got = members[item]
            assert all(len(wins) == 1 for _, wins in got), item
            train[i] = assemble_group([wins[0] for _, wins in got], [sx.weight for sx, _ in got], spec.chunk,
                                      got[0][0].source, item)
    if spec.group_prefix:
        train = group_by_prefix(train, spec.chunk)
    return RenderedJob(tuple(train), tuple(held_out))


def held_out_sources(sources: Iterable[int], val_split: float, seed: int) -> frozenset[int]:
    """Which body examples are held out: floor(n * val_split) of the n distinct
    sources, chosen by `seed`, always leaving at least one to train on. A
    group's completions share a source, so they are held out together."""
    distinct = sorted(set(sources))
    n_val = min(int(len(distinct) * val_split), max(len(distinct) - 1, 0))
    return frozenset(random.Random(seed).sample(distinct, n_val))


def epoch_order(n_windows: int, epoch: int, seed: int) -> list[int]:
    """The order windows are visited in `epoch`: a seeded shuffle, different per epoch."""
    order = list(range(n_windows))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order
