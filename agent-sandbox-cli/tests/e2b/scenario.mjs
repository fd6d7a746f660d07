// Drives `agent-sandbox serve`'s E2B-compatible API with the official E2B JavaScript SDK (`e2b`
// from npm, the version scripts/test.sh pins), through its public API only, as an E2B user
// would: `node scenario.mjs [STEP...]` with E2B_API_URL and E2B_SANDBOX_URL set to the server's
// base URL, E2B_API_KEY to "e2b_" + its bearer token, and AGENT_SANDBOX_TEST_NODE_MODULES to
// the node_modules directory the SDK is installed in (this file is not under it, and ESM
// imports ignore NODE_PATH, so the SDK is imported from there by file URL).
//
// Every step runs by default, in the order of STEPS; naming some runs only those (in that same
// order), to narrow a failure. Each passed step prints `ok: STEP`, the whole run `all ok`; a
// failed check is an AssertionError saying what was expected and what came.
//
// The sandbox's home, where commands start and relative paths resolve, is whatever `pwd`
// says: E2B's /home/user on our server unless the operator names another.
import assert from 'node:assert/strict'
import { readFileSync } from 'node:fs'
import { join, posix } from 'node:path'
import { pathToFileURL } from 'node:url'
import { inspect } from 'node:util'

const sdk = await importSdk()
const {
  AuthenticationError,
  CommandExitError,
  FileNotFoundError,
  FilesystemEventType,
  FileType,
  Sandbox,
  SandboxNotFoundError,
} = sdk

const METADATA = { suite: 'e2b-js' }

/** The SDK's ES module, from the node_modules directory AGENT_SANDBOX_TEST_NODE_MODULES names:
 * the entry its package.json gives `import` (its exports map's, else `module`, else `main`). */
async function importSdk() {
  const modules = process.env.AGENT_SANDBOX_TEST_NODE_MODULES
  assert.ok(modules, 'AGENT_SANDBOX_TEST_NODE_MODULES is not set (the node_modules with e2b)')
  const dir = join(modules, 'e2b')
  const pkg = JSON.parse(readFileSync(join(dir, 'package.json'), 'utf8'))
  let entry = pkg.exports?.['.'] ?? pkg.exports
  if (entry && typeof entry === 'object') entry = entry.import ?? entry.default
  if (entry && typeof entry === 'object') entry = entry.default
  entry = typeof entry === 'string' ? entry : pkg.module ?? pkg.main
  assert.ok(entry, `no ES module entry in ${join(dir, 'package.json')}`)
  console.log(`sdk: e2b ${pkg.version} (${join(dir, entry)}), node ${process.version}`)
  return import(pathToFileURL(join(dir, entry)).href)
}

/** The sandbox the steps share, made on first use and killed at the end (by the lifecycle
 * step, or else by `close`). */
class Run {
  #sandbox = null
  #home = null
  killed = false

  async sandbox() {
    if (this.#sandbox === null) {
      const sb = await Sandbox.create({
        timeoutMs: 120_000,
        metadata: METADATA,
        envs: { GREETING: 'hi' },
      })
      assert.ok(sb.sandboxId, `created a sandbox without an id: ${inspect(sb)}`)
      this.#sandbox = sb
      console.log(`ok: create (${sb.sandboxId})`)
    }
    return this.#sandbox
  }

  /** The sandbox's home: where commands start and relative paths resolve. */
  async home() {
    if (this.#home === null) {
      const pwd = (await (await this.sandbox()).commands.run('pwd')).stdout.trim()
      assert.ok(pwd.startsWith('/'), `pwd printed ${inspect(pwd)}, not an absolute path`)
      this.#home = pwd
    }
    return this.#home
  }

  async close() {
    if (this.#sandbox !== null && !this.killed) {
      try {
        await this.#sandbox.kill()
      } catch (e) {
        // the run's own failure, if any, is what matters
        console.error(`(could not kill ${this.#sandbox.sandboxId}: ${inspect(e)})`)
      }
    }
  }
}

/** `fn()` must reject with an `ErrorClass`; returns the error. */
async function expectError(ErrorClass, what, fn) {
  let got
  try {
    got = await fn()
  } catch (e) {
    if (e instanceof ErrorClass) return e
    throw new assert.AssertionError({
      message: `${what}: expected ${ErrorClass.name}, got ${inspect(e)}`,
    })
  }
  assert.fail(`${what}: expected ${ErrorClass.name}, got a result: ${inspect(got)}`)
}

/** Every sandbox a `Sandbox.list()` paginator yields, all pages. */
async function listed(paginator) {
  const items = []
  while (paginator.hasNext) items.push(...(await paginator.nextItems()))
  return items
}

/** The ids of every sandbox a `Sandbox.list()` paginator yields, all pages. */
async function ids(paginator) {
  return (await listed(paginator)).map((info) => info.sandboxId)
}

/** Waits up to `ms` for `cond()`; `what()` says what did not come. */
async function until(cond, ms, what) {
  const end = Date.now() + ms
  while (!cond()) {
    if (Date.now() > end) assert.fail(what())
    await new Promise((resolve) => setTimeout(resolve, 50))
  }
}

const sorted = (xs) => [...xs].sort()

/** Foreground commands: the sandbox's environment variables, its home, a command's own
 * environment and working directory, stdout and stderr apart, a non-zero exit. */
async function stepCommands(run) {
  const sb = await run.sandbox()
  const home = await run.home()
  let r = await sb.commands.run('echo $GREETING; pwd')
  assert.equal(r.exitCode, 0, `exit code ${r.exitCode}: ${inspect(r)}`)
  const lines = r.stdout.split('\n').filter((l) => l !== '')
  assert.equal(lines.length, 2, `expected two lines (GREETING, pwd), got ${inspect(r.stdout)}`)
  assert.equal(lines[0], 'hi', `the sandbox's envs did not reach the command: ${inspect(r.stdout)}`)
  assert.equal(lines[1], home, `pwd said ${inspect(lines[1])}, then ${inspect(home)}`)

  r = await sb.commands.run('echo "$FOO"; pwd', { envs: { FOO: 'bar' }, cwd: '/tmp' })
  assert.equal(r.stdout, 'bar\n/tmp\n', `envs/cwd of the command: ${inspect(r.stdout)}`)

  const out = []
  const err = []
  r = await sb.commands.run('echo out; echo err >&2', {
    onStdout: (d) => out.push(d),
    onStderr: (d) => err.push(d),
  })
  assert.deepEqual([r.stdout, r.stderr], ['out\n', 'err\n'], `stdout/stderr: ${inspect(r)}`)
  assert.deepEqual(
    [out.join(''), err.join('')],
    ['out\n', 'err\n'],
    `callbacks: ${inspect(out)} ${inspect(err)}`,
  )

  const e = await expectError(CommandExitError, 'exit 3', () =>
    sb.commands.run('echo oops >&2; exit 3'),
  )
  assert.equal(e.exitCode, 3, `exit code ${e.exitCode}, not 3: ${inspect(e)}`)
  assert.equal(e.stderr, 'oops\n', `stderr of the failed command: ${inspect(e.stderr)}`)
}

/** The filesystem: text and bytes in and out, a multi-file upload, listing, existence, entry
 * info, directories, renaming, removing, a missing file; and the same files seen by commands,
 * relative paths resolving to the same home. */
async function stepFiles(run) {
  const sb = await run.sandbox()
  const home = await run.home()
  const files = sb.files

  const w = await files.write('hello.txt', 'hello e2b\n')
  assert.equal(w.name, 'hello.txt', `write returned ${inspect(w)}`)
  assert.equal(w.path, posix.join(home, 'hello.txt'), `write returned ${inspect(w)} (home ${home})`)
  assert.equal(await files.read('hello.txt'), 'hello e2b\n')

  const blob = Uint8Array.from({ length: 256 }, (_, i) => i)
  await files.write('blob.bin', blob.buffer)
  const got = await files.read('blob.bin', { format: 'bytes' })
  assert.deepEqual(Buffer.from(got), Buffer.from(blob), `bytes came back as ${inspect(got)}`)

  // Two files in one upload, one of them into a directory that did not exist.
  const written = await files.writeFiles([
    { path: 'multi/one.txt', data: 'one' },
    { path: 'multi/two.bin', data: new Uint8Array([0, ...Buffer.from('two')]).buffer },
  ])
  assert.deepEqual(
    sorted(written.map((x) => x.name)),
    ['one.txt', 'two.bin'],
    `writeFiles returned ${inspect(written)}`,
  )
  assert.equal(await files.read('multi/one.txt'), 'one')
  assert.deepEqual(
    Buffer.from(await files.read('multi/two.bin', { format: 'bytes' })),
    Buffer.from('\0two', 'latin1'),
  )

  const top = Object.fromEntries((await files.list('.')).map((e) => [e.name, e]))
  for (const name of ['hello.txt', 'blob.bin', 'multi']) {
    assert.ok(name in top, `${name} not listed in ${inspect(sorted(Object.keys(top)))}`)
  }
  assert.equal(top['hello.txt'].type, FileType.FILE, inspect(top['hello.txt']))
  assert.equal(top.multi.type, FileType.DIR, inspect(top.multi))
  const inner = sorted((await files.list('multi')).map((e) => e.name))
  assert.deepEqual(inner, ['one.txt', 'two.bin'], `multi/ lists ${inspect(inner)}`)

  assert.equal(await files.exists('hello.txt'), true)
  assert.equal(await files.exists('multi'), true)
  assert.equal(await files.exists('nope.txt'), false)

  const info = await files.getInfo('blob.bin')
  assert.equal(info.type, FileType.FILE, inspect(info))
  assert.equal(info.size, 256, `size ${info.size}, not 256: ${inspect(info)}`)
  assert.equal(info.name, 'blob.bin', inspect(info))
  assert.equal(info.path, posix.join(home, 'blob.bin'), `${inspect(info)} (home ${home})`)

  assert.equal(await files.makeDir('d/e'), true, 'makeDir of a new directory')
  assert.equal(await files.makeDir('d/e'), false, 'makeDir of an existing directory')
  assert.equal((await files.getInfo('d/e')).type, FileType.DIR)

  const moved = await files.rename('hello.txt', 'd/e/moved.txt')
  assert.equal(moved.name, 'moved.txt', `rename returned ${inspect(moved)}`)
  assert.equal(moved.path, posix.join(home, 'd/e/moved.txt'), inspect(moved))
  assert.equal(await files.exists('hello.txt'), false, 'the old name is still there')
  assert.equal(await files.read('d/e/moved.txt'), 'hello e2b\n')

  // Commands see what the files API wrote, and the other way round.
  const r = await sb.commands.run('cat d/e/moved.txt multi/one.txt')
  assert.equal(r.stdout, 'hello e2b\none', `cat saw ${inspect(r.stdout)}`)
  await sb.commands.run('echo made > made.txt; echo abs > /tmp/abs.txt')
  assert.equal(await files.read('made.txt'), 'made\n')
  assert.equal(await files.read('/tmp/abs.txt'), 'abs\n', 'an absolute path')

  await files.remove('blob.bin')
  assert.equal(await files.exists('blob.bin'), false, 'a removed file')
  await files.remove('d') // a directory with what is in it
  assert.equal(await files.exists('d'), false, 'a removed directory')

  await expectError(FileNotFoundError, 'reading a missing file', () => files.read('missing.txt'))
}

/** A directory of the home watched through the SDK's stream (`watchDir`, recursive):
 * a file written through the file API and one made by a command in a subdirectory made
 * after the watch began; a missing directory is FileNotFound. */
async function stepWatch(run) {
  const sb = await run.sandbox()
  const d = `${await run.home()}/watched-js` // the home: the workspace, or its alias
  await sb.files.makeDir(d)
  const seen = []
  let wake = () => {}
  const handle = await sb.files.watchDir(
    d,
    (ev) => {
      seen.push(`${ev.type} ${ev.name}`)
      wake()
    },
    { recursive: true },
  )
  /** Waits (at most 30 s) until every one of `want` was seen. */
  const until = async (want) => {
    const deadline = Date.now() + 30_000
    while (!want.every((w) => seen.includes(w))) {
      assert.ok(Date.now() < deadline, `within 30 s: ${inspect(want)} not all in ${inspect(seen)}`)
      await new Promise((r) => {
        wake = r
        setTimeout(r, 500)
      })
    }
  }
  await sb.files.write(`${d}/a.txt`, 'one')
  await until([`${FilesystemEventType.CREATE} a.txt`, `${FilesystemEventType.WRITE} a.txt`])
  const r = await sb.commands.run(`mkdir ${d}/sub && echo two > ${d}/sub/b.txt`)
  assert.equal(r.exitCode, 0)
  await until([`${FilesystemEventType.CREATE} sub`, `${FilesystemEventType.CREATE} sub/b.txt`])
  await handle.stop()
  await expectError(FileNotFoundError, 'watching a missing directory', () =>
    sb.files.watchDir(`${d}/nope`, () => {}),
  )
}

/** A background command: listed while it runs, killed, its end an error, then gone. */
async function stepBackground(run) {
  const cmds = (await run.sandbox()).commands
  const h = await cmds.run('sleep 30', { background: true })
  assert.ok(Number.isInteger(h.pid) && h.pid > 0, `pid ${inspect(h.pid)}`)
  const mine = (await cmds.list()).filter((p) => p.pid === h.pid)
  assert.ok(mine.length, `pid ${h.pid} not in commands.list()`)
  assert.ok(
    [mine[0].cmd, ...mine[0].args].some((a) => a.includes('sleep 30')),
    inspect(mine[0]),
  )

  assert.equal(await cmds.kill(h.pid), true, 'kill of a running command')
  const e = await expectError(CommandExitError, 'wait for a killed command', () => h.wait())
  assert.notEqual(e.exitCode, 0, inspect(e))
  const pids = (await cmds.list()).map((p) => p.pid)
  assert.ok(!pids.includes(h.pid), 'a killed command is still listed')
  assert.equal(await cmds.kill(h.pid), false, 'kill of a command that is gone')
}

/** A command's stdin: written to, then closed (EOF), the command's output its input. */
async function stepStdin(run) {
  const cmds = (await run.sandbox()).commands
  const h = await cmds.run('cat', { background: true, stdin: true })
  await cmds.sendStdin(h.pid, 'hello\n')
  await cmds.closeStdin(h.pid)
  const r = await h.wait()
  assert.equal(r.stdout, 'hello\n', `cat echoed ${inspect(r.stdout)}`)
}

/** A background command outlives its stream: disconnected, it keeps running, and a new stream
 * to it sees the rest of its output and its end. */
async function stepConnect(run) {
  const cmds = (await run.sandbox()).commands
  const h = await cmds.run('for i in 1 2 3; do echo $i; sleep 1; done', { background: true })
  const pid = h.pid
  await h.disconnect()
  const pids = (await cmds.list()).map((p) => p.pid)
  assert.ok(pids.includes(pid), 'a disconnected command stopped running')
  const h2 = await cmds.connect(pid)
  assert.equal(h2.pid, pid, `connected to ${h2.pid}, not ${pid}`)
  const r = await h2.wait()
  assert.equal(r.exitCode, 0, inspect(r))
  const lines = r.stdout.split('\n').filter((l) => l !== '')
  assert.ok(
    lines.length &&
      lines.every((l) => ['1', '2', '3'].includes(l)) &&
      lines[lines.length - 1] === '3',
    inspect(r.stdout),
  )
}

/** A PTY: an interactive shell whose terminal has the size asked for, resized, exiting. */
async function stepPty(run) {
  const sb = await run.sandbox()
  let seen = Buffer.alloc(0)
  const h = await sb.pty.create({
    rows: 24,
    cols: 80,
    timeoutMs: 30_000,
    onData: (data) => {
      seen = Buffer.concat([seen, data])
    },
  })
  const text = () => inspect(seen.toString('latin1'))
  await sb.pty.sendInput(h.pid, Buffer.from('stty size\n'))
  await until(() => seen.includes('24 80'), 20_000, () => `no '24 80' from stty size: ${text()}`)
  const resizedAt = seen.length
  await sb.pty.resize(h.pid, { rows: 30, cols: 100 })
  await sb.pty.sendInput(h.pid, Buffer.from('stty size; exit\n'))
  let r
  try {
    r = await h.wait()
  } catch (e) {
    assert.fail(`the PTY's shell ended with ${inspect(e)}; it printed ${text()}`)
  }
  assert.ok(seen.subarray(resizedAt).includes('30 100'), `no '30 100' after resize: ${text()}`)
  assert.equal(r.exitCode, 0, `the PTY's shell exited with ${inspect(r)}`)
}

/** The sandbox as an API object: listed (with metadata, filtered by it), its timeout set, its
 * info, running; connected to; paused and resumed by connecting, its files kept; killed, and
 * then not found. */
async function stepLifecycle(run) {
  const sb = await run.sandbox()
  const sid = sb.sandboxId

  const found = (await listed(Sandbox.list())).filter((i) => i.sandboxId === sid)
  assert.ok(found.length, `${sid} not in Sandbox.list()`)
  assert.equal(
    found[0].metadata?.suite,
    METADATA.suite,
    `listed with ${inspect(found[0].metadata)}`,
  )
  assert.equal(found[0].state, 'running', `listed as ${inspect(found[0].state)}`)
  assert.ok(
    (await ids(Sandbox.list({ query: { metadata: METADATA } }))).includes(sid),
    'metadata filter',
  )
  const other = await ids(Sandbox.list({ query: { metadata: { suite: 'other' } } }))
  assert.ok(!other.includes(sid), 'listed under metadata it does not have')

  await sb.setTimeout(60_000)
  const info = await sb.getInfo()
  assert.equal(info.sandboxId, sid, inspect(info))
  assert.equal(info.state, 'running', inspect(info))
  assert.equal(info.metadata?.suite, METADATA.suite, inspect(info))
  // A time zone the server's endAt must carry: without one, it would be read as local time
  // (the test runs this under a TZ far from UTC) and be hours off.
  assert.ok(!Number.isNaN(info.endAt.getTime()), `endAt is not a time: ${inspect(info)}`)
  const left = (info.endAt.getTime() - Date.now()) / 1000
  assert.ok(
    left > 0 && left <= 65,
    `${left.toFixed(0)} s left after setTimeout(60 s): ${inspect(info)}`,
  )
  assert.equal(await sb.isRunning(), true)

  // Connecting to a running sandbox, as from elsewhere: the same one.
  const same = await Sandbox.connect(sid)
  assert.equal(same.sandboxId, sid)
  assert.equal((await same.commands.run('echo $GREETING')).stdout, 'hi\n')

  await sb.files.write('kept.txt', 'kept')
  assert.equal(await sb.pause(), true, 'pause of a running sandbox')
  assert.equal((await Sandbox.getInfo(sid)).state, 'paused')
  assert.equal(await sb.pause(), false, 'pause of a paused sandbox')
  const resumed = await Sandbox.connect(sid)
  assert.equal(resumed.sandboxId, sid)
  assert.equal((await resumed.getInfo()).state, 'running', 'connect did not resume it')
  const r = await resumed.commands.run('cat kept.txt')
  assert.equal(r.stdout, 'kept', `after resume: ${inspect(r.stdout)}`)

  assert.equal(await resumed.kill(), true, 'kill of a sandbox')
  run.killed = true
  await expectError(SandboxNotFoundError, 'getInfo of a killed sandbox', () =>
    Sandbox.getInfo(sid),
  )
  await expectError(SandboxNotFoundError, 'connect to a killed sandbox', () =>
    Sandbox.connect(sid),
  )
  assert.equal(await Sandbox.kill(sid), false, 'kill of a killed sandbox')
  assert.ok(!(await ids(Sandbox.list())).includes(sid), 'a killed sandbox is still listed')
}

/** Another key (well-formed, not the server's) is refused. */
async function stepAuth() {
  const key = process.env.E2B_API_KEY
  assert.ok(key.startsWith('e2b_'), "E2B_API_KEY must be e2b_ + the server's hex token")
  const hex = '0123456789abcdef'
  const wrong =
    'e2b_' + [...key.slice(4)].map((c) => hex[(hex.indexOf(c) + 1) % 16]).join('')
  let made
  try {
    made = await Sandbox.create({ timeoutMs: 30_000, apiKey: wrong })
  } catch (e) {
    assert.ok(e instanceof AuthenticationError, `create with a wrong API key: ${inspect(e)}`)
  }
  if (made !== undefined) {
    await Sandbox.kill(made.sandboxId)
    assert.fail('a sandbox was created with a wrong API key')
  }
  await expectError(AuthenticationError, 'listing with a wrong API key', () =>
    Sandbox.list({ apiKey: wrong }).nextItems(),
  )
}

/** An allow list with a denied host: the refused name is never looked up outside, and the
 * refusal is in the sandbox's log (E2B's logs endpoint, read with the API key). */
async function stepNetwork() {
  const sb = await Sandbox.create({
    timeoutMs: 120_000,
    metadata: METADATA,
    network: { allowOut: ['allowed.example'], denyOut: ['0.0.0.0/0'] },
  })
  try {
    const r = await sb.commands.run('getent hosts denied.example || echo refused')
    assert.ok(r.stdout.trim().endsWith('refused'), `denied.example was resolved: ${inspect(r)}`)
    const res = await fetch(
      `${process.env.E2B_API_URL}/v2/sandboxes/${sb.sandboxId}/logs?level=warn`,
      { headers: { 'X-API-Key': process.env.E2B_API_KEY } },
    )
    assert.equal(res.status, 200)
    const { logs } = await res.json()
    assert.ok(
      logs.some((l) => l.message === 'egress refused' && l.fields.host === 'denied.example'),
      `no refusal of denied.example in the log: ${inspect(logs)}`,
    )
  } finally {
    await sb.kill()
  }
}

/** A server the sandbox runs, reached through the sandbox URL with `E2b-Sandbox-Id` and
 * `E2b-Sandbox-Port` naming its port; a port nothing listens on is a 502 saying so. */
async function stepPorts(run) {
  const sb = await run.sandbox()
  await sb.files.write('site/index.html', 'served from the sandbox\n')
  const h = await sb.commands.run('python3 -m http.server 8000 --bind 127.0.0.1', {
    background: true,
    cwd: 'site',
  })
  const url = process.env.E2B_SANDBOX_URL.replace(/\/$/, '') + '/index.html'
  const to = { 'E2b-Sandbox-Id': sb.sandboxId, 'E2b-Sandbox-Port': '8000' }
  let r
  const end = Date.now() + 30_000
  for (;;) {
    r = await fetch(url, { headers: to })
    if (r.status === 200 || Date.now() > end) break
    await new Promise((resolve) => setTimeout(resolve, 200))
  }
  assert.equal(r.status, 200, `port 8000: ${r.status}`)
  assert.equal(await r.text(), 'served from the sandbox\n')
  r = await fetch(url, { headers: { ...to, 'E2b-Sandbox-Port': '8001' } })
  assert.equal(r.status, 502, 'port 8001 (nothing there)')
  assert.match((await r.json()).message, /8001/)
  assert.equal(await sb.commands.kill(h.pid), true)
}

/** A snapshot restored as a template, then forked twice, each copy on its own (a sandbox of
 * its own, the internet off: a tier may refuse to checkpoint one with a network path out). */
async function stepSnapshots() {
  const sb = await Sandbox.create({ timeoutMs: 120_000, allowInternetAccess: false, metadata: METADATA })
  const made = []
  try {
    await sb.files.write('state.txt', 'before')
    const snap = await sb.createSnapshot()
    assert.ok(snap.snapshotId, `snapshot without an id: ${inspect(snap)}`)
    await sb.files.write('state.txt', 'after')
    const restored = await Sandbox.create(snap.snapshotId, { timeoutMs: 60_000 })
    made.push(restored)
    assert.equal(await restored.files.read('state.txt'), 'before')
    const forks = await sb.fork({ count: 2 })
    for (const f of forks) assert.ok(!(f instanceof Error), `a fork failed: ${inspect(f)}`)
    made.push(...forks)
    await forks[0].files.write('state.txt', 'changed in fork 0')
    assert.equal(await forks[1].files.read('state.txt'), 'after', 'a fork saw another\'s write')
    assert.equal(await sb.files.read('state.txt'), 'after', 'the original saw a fork\'s write')
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false, 'deleted twice')
  } finally {
    for (const s of [...made, sb]) await s.kill()
  }
}

const STEPS = {
  commands: stepCommands,
  files: stepFiles,
  watch: stepWatch,
  background: stepBackground,
  stdin: stepStdin,
  connect: stepConnect,
  pty: stepPty,
  ports: stepPorts,
  network: stepNetwork,
  snapshots: stepSnapshots,
  lifecycle: stepLifecycle, // kills the shared sandbox: last of those that use it
  auth: stepAuth,
}

async function main(argv) {
  const unknown = argv.filter((a) => !(a in STEPS))
  if (unknown.length) {
    const steps = Object.keys(STEPS).join(' ')
    console.error(`unknown step(s) ${unknown.join(' ')}; the steps: ${steps}`)
    process.exit(2)
  }
  for (const v of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_API_KEY']) {
    assert.ok(process.env[v], `${v} is not set`)
  }
  const chosen = Object.keys(STEPS).filter((name) => !argv.length || argv.includes(name))
  const run = new Run()
  try {
    for (const name of chosen) {
      await STEPS[name](run)
      console.log(`ok: ${name}`)
    }
  } finally {
    await run.close()
  }
  console.log('all ok')
}

await main(process.argv.slice(2))
