"""The report's trajectory viewer: each turn, its tool calls with arguments and
outputs, and the final diff.

Everything shown comes from trajectories, that is from a model and from
programs it ran: all of it is arbitrary text and goes through `html.escape`
(attributes too). Long texts keep their head and tail so one runaway tool
output cannot bloat the page. One trajectory is shown at a time; a `<select>`
and a few lines of inline JS switch between them.
"""

from __future__ import annotations

import json
from html import escape
from typing import Any, Sequence

from atelier.harness.trajectory import Trajectory

MAX_CHARS = 12_000


def clip(text: str, limit: int = MAX_CHARS) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n… [{len(text) - limit} characters left out] …\n{text[-half:]}"


def _content(message: dict[str, Any]) -> str:
    content = message.get("content", "")
    if isinstance(content, list):  # OpenAI content parts
        content = "\n".join(str(p.get("text", p)) if isinstance(p, dict) else str(p) for p in content)
    text = str(content or "")
    if message.get("tool_calls"):
        text += ("\n" if text else "") + json.dumps(message["tool_calls"], indent=1, default=str)
    return text


def diff_html(diff: str) -> str:
    if not diff.strip():
        return '<p class="muted">(no change)</p>'
    lines = []
    for line in clip(diff, 4 * MAX_CHARS).splitlines():
        cls = ("add" if line.startswith("+") and not line.startswith("+++") else
               "del" if line.startswith("-") and not line.startswith("---") else
               "hunk" if line.startswith("@@") else
               "meta" if line.startswith(("diff ", "+++", "---", "index ")) else "")
        lines.append(f'<span class="{cls}">{escape(line)}</span>' if cls else escape(line))
    return '<pre class="diff">' + "\n".join(lines) + "</pre>"


def _call_html(call) -> str:
    state = "broken" if call.broken else ("ok" if call.ok else "failed")
    args = json.dumps(call.arguments, indent=1, ensure_ascii=False, default=str)
    return (f'<div class="call {state}"><div class="callhead">tool <b>{escape(call.name)}</b> '
            f'<span class="tag {state}">{state}</span> '
            f'<span class="muted">{call.duration_s:.2f} s</span></div>'
            f'<div class="label">arguments</div><pre>{escape(clip(args))}</pre>'
            f'<div class="label">output</div><pre>{escape(clip(call.output))}</pre></div>')


def trajectory_html(traj: Trajectory, dom_id: str, title: str) -> str:
    """One trajectory as a block: header, messages with their turn's tool calls, diff."""
    calls_by_turn: dict[int, list] = {}
    for call in traj.tool_calls:
        calls_by_turn.setdefault(call.turn, []).append(call)
    first_turn = min(calls_by_turn, default=0)
    base = 1 if first_turn >= 1 and 0 not in calls_by_turn else 0
    parts, turn = [], base - 1
    for message in traj.messages:
        role = str(message.get("role", "?"))
        if role == "assistant":
            turn += 1
        body = f"<pre>{escape(clip(_content(message)))}</pre>"
        if role == "system":  # the same long tool specification in every trajectory: folded
            body = f"<details><summary>system prompt</summary>{body}</details>"
        parts.append(f'<div class="msg {escape(role)}"><div class="role">{escape(role)}'
                     + (f' · turn {turn}' if role == "assistant" else "") + f"</div>{body}</div>")
        if role == "assistant":
            parts.extend(_call_html(c) for c in calls_by_turn.pop(turn, []))
    for leftover in sorted(calls_by_turn):
        parts.extend(_call_html(c) for c in calls_by_turn[leftover])
    tokens = ", ".join(f"{escape(k)} {v}" for k, v in sorted(traj.tokens.items())) or "none recorded"
    reward = "—" if traj.reward is None else f"{traj.reward:g}"
    parts_text = ", ".join(f"{escape(k)} {v:.2f}" for k, v in traj.reward_parts.items())
    head = (f'<h3>{escape(title)}</h3><p class="meta">reward <b>{reward}</b>'
            + (f" ({parts_text})" if parts_text else "")
            + f" · exit <b>{escape(traj.exit_reason or '?')}</b> · {traj.turns} turns · "
            f"{traj.num_tool_calls} tool calls ({traj.broken_calls} broken) · "
            f"{traj.wall_s:.1f} s · tokens: {tokens}</p>")
    if traj.error:
        head += f'<p class="error">error: {escape(clip(traj.error, 2000))}</p>'
    return (f'<div class="traj" id="{escape(dom_id)}" data-title="{escape(title)}">{head}'
            f'<details open><summary>turns ({len(traj.messages)} messages)</summary>{"".join(parts)}'
            f'</details><details open><summary>final diff</summary>{diff_html(traj.final_diff)}'
            "</details></div>")


def viewer_html(items: Sequence[tuple[str, str, Trajectory]]) -> str:
    """items: (dom id, title, trajectory). A selector and the blocks; the JS in
    the page shows the selected one."""
    if not items:
        return '<p class="muted">No trajectories were saved in these runs.</p>'
    options = "".join(f'<option value="{escape(dom_id)}">{escape(title)}</option>'
                      for dom_id, title, _ in items)
    blocks = "".join(trajectory_html(t, dom_id, title) for dom_id, title, t in items)
    return (f'<label for="traj-select">trajectory </label><select id="traj-select">{options}'
            f'</select><div id="traj-blocks">{blocks}</div>')


VIEWER_JS = """
(function () {
  var select = document.getElementById('traj-select');
  if (!select) return;
  function show(id) {
    var blocks = document.querySelectorAll('#traj-blocks .traj');
    for (var i = 0; i < blocks.length; i++) {
      blocks[i].style.display = blocks[i].id === id ? 'block' : 'none';
    }
    select.value = id;
    document.getElementById('viewer').setAttribute('data-shown', id);
  }
  select.addEventListener('change', function () { show(select.value); });
  var links = document.querySelectorAll('a.show-traj');
  for (var i = 0; i < links.length; i++) {
    links[i].addEventListener('click', function (ev) {
      ev.preventDefault();
      show(this.getAttribute('data-traj'));
      document.getElementById('viewer').scrollIntoView();
    });
  }
  show(select.value);
})();
"""
