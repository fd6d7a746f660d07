// Drives `agent-sandbox serve`'s E2B code interpreter (port 49999) with the official
// `@e2b/code-interpreter` JavaScript SDK (the version scripts/test.sh pins), through its
// public API only: `Sandbox.create()` (the default `code-interpreter-v1` template), `runCode`
// with callbacks, contexts, per-call `envs`, a `timeoutMs` that interrupts the cell. The same
// checks as interpreter.py, as the SDK's own JS tests make them. Prints `ok: STEP` per step
// and `all ok`; AGENT_SANDBOX_TEST_NODE_MODULES names the node_modules the SDK is in (ESM
// imports ignore NODE_PATH, so it is imported from there by file URL).
import assert from 'node:assert/strict'
import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import { pathToFileURL } from 'node:url'

const HOME = process.env.E2B_EXPECT_HOME ?? '/home/user'

async function importSdk() {
  const dir = join(process.env.AGENT_SANDBOX_TEST_NODE_MODULES, '@e2b', 'code-interpreter')
  const pkg = JSON.parse(readFileSync(join(dir, 'package.json'), 'utf8'))
  let entry = pkg.exports?.['.'] ?? pkg.exports
  if (entry && typeof entry === 'object') entry = entry.import ?? entry.default
  if (entry && typeof entry === 'object') entry = entry.default
  entry = typeof entry === 'string' ? entry : pkg.module ?? pkg.main
  console.log(`sdk: @e2b/code-interpreter ${pkg.version}, node ${process.version}`)
  return import(pathToFileURL(join(dir, entry)).href)
}

const { Sandbox } = await importSdk()
const sbx = await Sandbox.create({ timeoutMs: 120_000 })
try {
  assert.equal((await sbx.runCode('x =1; x')).text, '1')
  const two = await sbx.runCode('x+=1; x')
  assert.equal(two.text, '2')
  assert.equal(two.executionCount, 2)
  assert.equal((await sbx.runCode('import os; os.getcwd()')).text, HOME)
  console.log('ok: basics')

  const out = []
  const results = []
  const errors = []
  const hello = await sbx.runCode('print("Hello from e2b")', { onStdout: (m) => out.push(m.line) })
  assert.deepEqual(hello.logs.stdout, ['Hello from e2b\n'])
  assert.deepEqual(out, ['Hello from e2b\n'])
  const code = "class H:\n    def _repr_html_(self): return '<b>h</b>'\ndisplay(H())\n40 + 2"
  const shown = await sbx.runCode(code, { onResult: (r) => results.push(r) })
  assert.equal(results.length, 2)
  assert.deepEqual(shown.results.map((r) => r.isMainResult), [false, true])
  assert.equal(shown.results[0].html, '<b>h</b>')
  assert.equal(shown.text, '42')
  const failed = await sbx.runCode('xyz', { onError: (e) => errors.push(e) })
  assert.equal(failed.error.name, 'NameError')
  assert.equal(errors.length, 1)
  console.log('ok: callbacks')

  const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
  assert.equal(ctx.cwd, '/tmp')
  assert.equal((await sbx.runCode('import os; os.getcwd()', { context: ctx })).text, '/tmp')
  const listed = await sbx.listCodeContexts()
  assert.equal(listed[listed.length - 1].id, ctx.id)
  await sbx.runCode('here = 1', { context: ctx })
  await sbx.restartCodeContext(ctx)
  const gone = await sbx.runCode('here', { context: ctx })
  assert.equal(gone.error.value, "name 'here' is not defined")
  await sbx.removeCodeContext(ctx)
  assert.ok(!(await sbx.listCodeContexts()).some((c) => c.id === ctx.id))
  console.log('ok: contexts')

  const env = await sbx.runCode("import os; os.getenv('ONLY')", { envs: { ONLY: 'now' } })
  assert.equal(env.text, 'now')
  assert.equal((await sbx.runCode("os.getenv('ONLY')")).text, undefined)
  console.log('ok: envs')

  await sbx.runCode('kept = 5')
  await assert.rejects(sbx.runCode('import time; time.sleep(300)', { timeoutMs: 3000 }))
  assert.equal((await sbx.runCode('kept + 1')).text, '6')
  console.log('ok: interrupt')
} finally {
  await sbx.kill()
}
console.log('all ok')
