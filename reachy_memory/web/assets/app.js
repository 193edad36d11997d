// The household page: reads /api/overview, lists what is kept, and forgets on request.
// Text from the memory is only ever set as textContent (never parsed as HTML).
"use strict";

const csrf = document.querySelector('meta[name="csrf-token"]').content;
const $ = (id) => document.getElementById(id);

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("data-")) node.setAttribute(key, value);
    else node[key] = value;
  }
  for (const child of children) if (child) node.append(child);
  return node;
}

async function api(path, body) {
  const options = body === undefined ? {} : {
    method: "POST", headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf },
    body: JSON.stringify(body),
  };
  const response = await fetch(path, { credentials: "same-origin", ...options });
  let data = null;
  try { data = await response.json(); } catch (e) { data = null; }
  if (!response.ok) {
    if (response.status === 401) { window.location.reload(); }
    throw new Error((data && data.error) || `the page's server answered ${response.status}`);
  }
  return data;
}

let toastTimer = null;
function toast(message, error = false) {
  const box = $("toast");
  box.textContent = message;
  box.classList.toggle("error", error);
  box.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => { box.hidden = true; }, error ? 6000 : 3000);
}

// The confirmation dialog: resolves true when the user chose to forget.
function confirmForget(title, text, yesLabel) {
  const dialog = $("confirm");
  $("confirm-title").textContent = title;
  $("confirm-text").textContent = text;
  $("confirm-yes").textContent = yesLabel;
  dialog.returnValue = "";
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "forget"), { once: true });
    dialog.showModal();
    $("confirm-no").focus();
  });
}

function shorten(text, max = 160) {
  return text.length > max ? text.slice(0, max - 1) + "…" : text;
}

function memoryItem(m, { showDay = false } = {}) {
  const meta = [];
  if (showDay) meta.push(m.day);
  meta.push(m.time);
  if (m.type === "context" || (showDay && m.type === "conversation")) meta.push(m.type);
  if (m.speaker) meta.push(m.speaker);
  if (m.about && m.about.length) meta.push("about " + m.about.join(", "));
  if (m.owner) meta.push(m.shared ? `${m.owner}'s, shared` : `${m.owner}'s`);
  const text = el("div", { class: "text" });
  if (m.type === "conversation" && m.role) text.append(el("span", { class: "role", text: m.role + ": " }));
  text.append(document.createTextNode(m.text));
  if (m.replaced) text.append(el("span", { class: "badge", text: "replaced" }));
  if (m.note) text.append(el("span", { class: "badge", text: "note: " + m.note }));
  const button = el("button", { class: "forget", type: "button", text: "Forget", "data-id": m.id });
  button.setAttribute("aria-label", "Forget: " + shorten(m.text, 60));
  button.addEventListener("click", () => forgetMemory(m, button));
  return el("li", { class: "memory" + (m.replaced ? " replaced" : ""), "data-id": m.id },
    el("div", { class: "body" }, text, el("div", { class: "meta", text: meta.join(" · ") })), button);
}

async function forgetMemory(m, button) {
  const ok = await confirmForget("Forget this?", `“${shorten(m.text)}” will be deleted for good.`, "Forget");
  if (!ok) return;
  button.disabled = true;
  try {
    await api("/api/forget", { id: m.id });
    document.querySelectorAll(`li.memory[data-id="${CSS.escape(m.id)}"]`).forEach((li) => li.remove());
    toast("Forgotten.");
  } catch (error) {
    button.disabled = false;
    toast(error.message, true);
  }
}

function plural(n, one, many) { return `${n} ${n === 1 ? one : many}`; }

function personSummary(p, plan) {
  const parts = [];
  if (plan.memories_deleted) parts.push(plural(plan.memories_deleted, "memory about them", "memories about them") + " deleted");
  if (plan.turns_deleted) parts.push(plural(plan.turns_deleted, "conversation turn", "conversation turns") + " deleted");
  if (plan.mentions_rewritten) parts.push(`their name removed from ${plural(plan.mentions_rewritten, "other memory", "other memories")}`);
  if (plan.window_turns_dropped) parts.push(plural(plan.window_turns_dropped, "turn", "turns") + " dropped from the current conversation");
  const aliases = plan.aliases && plan.aliases.length ? ` and the other names (${plan.aliases.join(", ")})` : "";
  return `Reachy will forget ${p.name}${aliases}` + (parts.length ? ": " + parts.join("; ") + "." : ".") +
    " This cannot be undone.";
}

async function forgetPerson(p, button) {
  button.disabled = true;
  try {
    const plan = await api("/api/forget-person", { id: p.id, dry_run: true });
    const ok = await confirmForget(`Forget everything about ${p.name}?`, personSummary(p, plan), `Forget ${p.name}`);
    if (!ok) return;
    const done = await api("/api/forget-person", { id: p.id, dry_run: false });
    toast(`${p.name} forgotten (${plural(done.memories_deleted + done.turns_deleted, "memory", "memories")} deleted).`);
    await load();
  } catch (error) {
    toast(error.message, true);
  } finally {
    button.disabled = false;
  }
}

function list(items, empty, options) {
  const ul = el("ul", { class: "memories" });
  for (const m of items) ul.append(memoryItem(m, options));
  return items.length ? ul : el("p", { class: "empty", text: empty });
}

function renderPeople(people) {
  const box = $("people-list");
  box.replaceChildren();
  if (!people.length) { box.append(el("p", { class: "empty", text: "Reachy knows nobody by name yet." })); return; }
  for (const p of people) {
    const who = el("div", { class: "who" }, el("h3", { text: p.name }));
    if (p.relation && p.name !== `the user's ${p.relation}`) who.append(el("span", { class: "relation", text: p.relation }));
    const card = el("article", { class: "person", "data-id": p.id }, who);
    if (p.aliases.length) card.append(el("p", { class: "aliases", text: "Also called " + p.aliases.join(", ") }));
    card.append(list(p.facts, "Nothing remembered about them yet."));
    if (p.more_facts) card.append(el("p", { class: "empty", text: `and ${p.more_facts} older (search to find them)` }));
    const button = el("button", { class: "forget-person", type: "button", text: `Forget everything about ${p.name}` });
    button.addEventListener("click", () => forgetPerson(p, button));
    card.append(button);
    box.append(card);
  }
}

function renderDays(days, shown) {
  const box = $("days");
  box.replaceChildren();
  if (!days.length) { box.append(el("p", { class: "empty", text: `No conversation in the last ${shown} days.` })); return; }
  for (const day of days) {
    const section = el("div", { class: "day" }, el("h3", { text: day.label }), list(day.turns, ""));
    if (day.more) section.append(el("p", { class: "empty", text: `and ${day.more} earlier that day (search to find them)` }));
    box.append(section);
  }
}

function untilText(status) {
  if (!status.until) return "";
  const until = new Date(status.until * 1000);
  const sameDay = until.toDateString() === new Date().toDateString();
  return until.toLocaleString([], sameDay ? { hour: "2-digit", minute: "2-digit" }
    : { weekday: "short", hour: "2-digit", minute: "2-digit" });
}

function renderStatus(status) {
  const paused = !!status.paused;
  const badge = $("status");
  badge.textContent = paused ? `Not remembering until ${untilText(status)}` : "Remembering";
  badge.classList.toggle("paused", paused);
  $("pause-row").hidden = paused;
  $("resume-row").hidden = !paused;
  document.querySelector(".controls").classList.toggle("paused", paused);
}

async function load() {
  const data = await api("/api/overview");
  renderStatus(data.remembering);
  renderPeople(data.people);
  $("facts-list").replaceWith(Object.assign(list(data.facts, "Nothing else."), { id: "facts-list" }));
  renderDays(data.days, data.days_shown);
  const c = data.counts;
  $("counts").textContent = `${plural(c.memories, "memory", "memories")}, ${plural(c.people, "person", "people")}`;
}

async function search(event) {
  event.preventDefault();
  const q = $("search").value.trim();
  if (!q) { $("results").hidden = true; return; }
  try {
    const data = await api("/api/search?q=" + encodeURIComponent(q));
    $("results-list").replaceWith(Object.assign(list(data.results, `Nothing found for “${q}”.`, { showDay: true }),
      { id: "results-list" }));
    $("results").hidden = false;
  } catch (error) {
    toast(error.message, true);
  }
}

async function setPause(path, body, message) {
  try {
    renderStatus(await api(path, body));
    toast(message);
  } catch (error) {
    toast(error.message, true);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("search-form").addEventListener("submit", search);
  $("search").addEventListener("search", (e) => { if (!e.target.value) $("results").hidden = true; });
  $("clear-search").addEventListener("click", () => { $("search").value = ""; $("results").hidden = true; });
  $("pause").addEventListener("click", () => setPause("/api/pause", { minutes: Number($("pause-minutes").value) },
    "Paused: nothing is written down until then."));
  $("resume").addEventListener("click", () => setPause("/api/resume", {}, "Remembering again."));
  load().catch((error) => { $("status").textContent = "Unavailable"; toast(error.message, true); });
  setInterval(() => { if (!$("confirm").open) api("/api/overview").then((d) => renderStatus(d.remembering)).catch(() => {}); }, 60000);
});
