#!/usr/bin/env node
import './threadpool.js';
import { main } from './main.js';

process.exitCode = await main(process.argv.slice(2));
